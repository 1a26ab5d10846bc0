//! The kernels a test compiles and loads call back into this crate (`ferry_emu_ctx`, the
//! barriers). In `libamdhip64.so.5` those are exported symbols; in this crate's own test
//! binaries they must be exported from the executable for the loaded module to find them.
fn main() {
    println!("cargo:rustc-link-arg-tests=-rdynamic");
}
