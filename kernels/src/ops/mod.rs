//! Backend-independent planning shared by the CPU reference and the GPU backends.
//!
//! | module | owns |
//! |---|---|
//! | [`mla_plan`] | which head counts the tiled absorbed-MLA kernel takes, and the zero-pad plan for the rest |

pub mod mla_plan;

pub use mla_plan::{is_supported_tile_heads, HeadPadPlan, TILE_ROWS};
