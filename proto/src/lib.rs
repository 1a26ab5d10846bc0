//! ferry's wire contracts.
//!
//! | module | owns |
//! |---|---|
//! | [`v1`] | the public `ferry.v1.Inference` service (Generate, Tokenize, ListModels) |
//! | [`internal`] | worker services (prefill, decode), the registry (registration, heartbeats, load, KV events) and KV-transfer control frames |
//! | [`auth`] | the internal plane's cluster token and the tonic interceptors that attach and check it |
//! | [`ids`] | newtype ids shared by every process |
//! | [`block_hash`] | prefix identity: the chained block hashes router and workers must compute alike |
//! | [`codec`] | the stubs' codec: prost's, with an undecodable request INVALID_ARGUMENT (not INTERNAL) |
//! | [`reflection`] | server reflection v1 + v1alpha routes advertising exactly the services a listener serves, health included |
//! | [`trace_ctx`] | W3C trace context on HTTP headers, gRPC metadata and the transfer hello |
//! | [`FILE_DESCRIPTOR_SET`] | the encoded descriptors, for gRPC server reflection |
//!
//! Stubs are generated at build time by `tonic-prost-build` with a vendored `protoc`.
#![forbid(unsafe_code)]

pub mod auth;
pub mod block_hash;
pub mod codec;
pub mod ids;
pub mod reflection;
pub mod trace_ctx;

/// Generated code, nested like the protobuf packages so cross-package references resolve.
pub mod ferry {
    /// The public API, package `ferry.v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("ferry.v1");
    }
    /// Internal packages.
    pub mod internal {
        /// Internal services, package `ferry.internal.v1`.
        pub mod v1 {
            #![allow(missing_docs, clippy::all)]
            tonic::include_proto!("ferry.internal.v1");
        }
    }
}

pub use ferry::internal::v1 as internal;
pub use ferry::v1;

/// Encoded `FileDescriptorSet` of every ferry proto, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ferry_descriptor");
