//! The engine thread's end: when the last `EngineHandle` is dropped, the drop returns only after
//! the engine thread has finished its step and dropped the model and its KV cache. A process
//! that returned from `main` with its engine thread still inside the GPU runtime met the CUDA
//! teardown at exit (segfaults after the work was done; docs/gpu.md). Its own test binary: the
//! check counts the process's `ferry-engine` threads, which other tests' engines would change.

mod common;

use ferry_model::deepseek::DeepseekModel;
use ferry_model::engine::{EngineConfig, EngineHandle, PrefillSource};

use common::{golden_case, job};

/// Threads of this process named `ferry-engine` (Linux: /proc/self/task/*/comm). A new thread
/// names itself once it runs, so a count right after the spawn may still miss it: see
/// [`engine_threads_settled`].
fn engine_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "ferry-engine")
        .count()
}

/// [`engine_threads`] once it reads `want`, or what it reads after 10 s.
fn engine_threads_settled(want: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let n = engine_threads();
        if n == want || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn dropping_the_last_handle_waits_for_the_engine_thread_to_end() {
    let model = DeepseekModel::load(&ferry_model::embedded::default_model_dir()).expect("model");
    let config = EngineConfig {
        num_blocks: 64,
        ..EngineConfig::default()
    };
    let engine = EngineHandle::spawn(model, config).expect("engine");
    assert_eq!(engine_threads_settled(1), 1, "the engine thread runs");
    // A long generation keeps the engine stepping while its handles go.
    let (prompt, _) = golden_case(0);
    let generation = engine
        .generate(job(prompt, 400, PrefillSource::Local))
        .expect("generate");
    let other = engine.clone();
    drop(engine);
    assert_eq!(engine_threads(), 1, "a handle is left: the engine runs on");
    drop(other);
    assert_eq!(
        engine_threads(),
        0,
        "the last handle's drop returned before the engine thread ended"
    );
    drop(generation);
}
