//! ferry's wire contracts (not yet built).
//!
//! This crate will own the versioned protobuf packages and their tonic/prost stubs: the public
//! `ferry.v1.Inference` service (Generate, Tokenize, ListModels), the internal worker, registry
//! and transfer-control services, the newtype ids shared by every process (`RequestId`,
//! `WorkerId`, `BlockHash`, ...), wire → domain conversions and W3C trace-context propagation on
//! gRPC metadata. See `docs/architecture.md`.
#![forbid(unsafe_code)]
