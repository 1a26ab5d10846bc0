//! Compiles the kernel sources to PTX with NVRTC, without a GPU, for checking them offline:
//! `cargo run -p ferry-kernels --example ptx -- <major> <minor> <out-dir> [NAME=VALUE ...]`
//! writes `<out-dir>/{common,mla}.ptx` for compute capability `major.minor` with the
//! DeepSeek-V3 MLA shape (plus any extra defines). Feed the PTX to `ptxas -v --gpu-name
//! sm_90a` to see register use, spills and wgmma serialisation warnings.
use ferry_kernels::cuda::mla::MlaShape;
use ferry_kernels::cuda::nvrtc::compile_ptx;
use ferry_kernels::gpu::{Defines, Source};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [major, minor, out, extra @ ..] = args.as_slice() else {
        return Err("usage: ptx <major> <minor> <out-dir> [NAME=VALUE ...]".into());
    };
    let cc = (major.parse()?, minor.parse()?);
    let mut mla = MlaShape::DEEPSEEK_V3.defines();
    for kv in extra {
        let (k, v) = kv.split_once('=').ok_or("defines are NAME=VALUE")?;
        mla = mla.with(k, v);
    }
    std::fs::create_dir_all(out)?;
    for (source, defines) in [(Source::Common, Defines::new()), (Source::Mla, mla)] {
        let ptx = compile_ptx(source, &defines, cc)?;
        let path = format!("{out}/{}.ptx", source.name().trim_end_matches(".cu"));
        std::fs::write(&path, ptx)?;
        println!("{path}");
    }
    Ok(())
}
