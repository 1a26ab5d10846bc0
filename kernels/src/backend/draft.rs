//! The drafter's ops on the backend (written by the drafter-ops work).
