//! Launchers for `gpu/draft.cu` (written by the drafter-ops work).
