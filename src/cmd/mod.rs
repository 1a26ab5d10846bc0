//! One module per subcommand.
pub mod bench_engine;
pub mod generate;
