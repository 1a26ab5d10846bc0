//! Sampling on the backend (written by the sampling work).
