//! One module per subcommand.
pub mod bench;
pub mod bench_engine;
pub mod bench_gpu;
pub mod bench_transfer;
pub mod generate;
pub mod health;
pub mod pass_cost;
pub mod serve;
pub mod up;
