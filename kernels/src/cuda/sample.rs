//! Launchers for `gpu/sample.cu` (written by the sampling work).
