//! The engine thread through its handle: continuous batching, prefix reuse, remote prefill
//! (a second engine playing the prefill peer), failure policies, cancellation, block accounting.

mod common;

use std::sync::{Arc, Mutex};

use ferry_model::deepseek::{BatchInputs, DeepseekModel, LogitsWanted, SeqInput};
use ferry_model::engine::{
    EngineConfig, EngineError, EngineEvent, EngineHandle, FinishReason, PrefillSource,
};
use ferry_model::kv::{BlockId, KvDtype, LayerRows, Lease};

use common::{collect, golden_case, greedy, job, tokens, wait_idle};

fn engine(blocks: usize) -> EngineHandle {
    engine_with(EngineConfig {
        num_blocks: blocks,
        max_batch_tokens: 256,
        ..EngineConfig::default()
    })
}

/// The embedded model's engine under `config`.
fn engine_with(config: EngineConfig) -> EngineHandle {
    let dir = ferry_model::embedded::default_model_dir();
    let model = DeepseekModel::load(&dir).expect("model");
    EngineHandle::spawn(model, config).expect("engine")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_the_reference_and_free_every_block() {
    let e = engine(128);
    let mut gens = Vec::new();
    for i in 0..3 {
        let (p, _) = golden_case(i);
        gens.push(e.generate(job(p, 32, PrefillSource::Local)).unwrap());
    }
    for (i, g) in gens.into_iter().enumerate() {
        let (toks, end) = collect(g).await;
        assert_eq!(end, Ok(FinishReason::Length));
        assert_eq!(toks, golden_case(i).1, "request {i} in a continuous batch");
    }
    wait_idle(&e).await;
}

/// The step counters a worker's dashboard reads: one request alone is one step with prompt
/// work (its prefill samples the first token), then one plain decode step per later token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_are_counted_and_timed_by_kind() {
    let e = engine(64);
    let (p, _) = golden_case(0);
    let g = e.generate(job(p, 12, PrefillSource::Local)).unwrap();
    let (toks, end) = collect(g).await;
    assert_eq!((toks.len(), end), (12, Ok(FinishReason::Length)));
    let t = e.stats().await.unwrap().step_times;
    assert_eq!((t.prompt.steps, t.decode.steps, t.round.steps), (1, 11, 0));
    // One decoding sequence in every decode step, one row each (no drafts); the prompt step
    // ran before the sequence was decoding.
    assert_eq!((t.decode.sequences, t.decode.decode_rows), (11, 11));
    assert_eq!((t.prompt.sequences, t.round.sequences), (0, 0));
    // Without a drafter nothing is planned; every step runs a forward and samples.
    for k in [t.prompt, t.decode] {
        assert_eq!(k.plan_us, 0, "{t:?}");
        assert!(
            k.launch_us > 0 && k.sample_us > 0 && k.total_us() > 0,
            "{t:?}"
        );
    }
    assert_eq!(t.round.total_us(), 0);
    wait_idle(&e).await;
}

/// Requests submitted together (`generate_all`) are admitted before the engine's next step:
/// all three prompts are one prompt step, then every decode step carries all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_submitted_together_share_their_first_step() {
    // A step budget that holds all three prompts.
    let e = engine_with(EngineConfig {
        num_blocks: 128,
        max_batch_tokens: 2048,
        ..EngineConfig::default()
    });
    let jobs = (0..3)
        .map(|i| job(golden_case(i).0, 12, PrefillSource::Local))
        .collect();
    let gens = e.generate_all(jobs).unwrap();
    for (i, g) in gens.into_iter().enumerate() {
        let (toks, end) = collect(g).await;
        assert_eq!(end, Ok(FinishReason::Length));
        assert_eq!(toks, golden_case(i).1[..12], "request {i}");
    }
    let t = e.stats().await.unwrap().step_times;
    assert_eq!((t.prompt.steps, t.decode.steps), (1, 11), "{t:?}");
    assert_eq!(t.decode.sequences, 33, "{t:?}");
    wait_idle(&e).await;
}

/// `generate_all` over the in-flight limit submits nothing and holds no slot afterwards: the
/// same requests fit once fewer are asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_submitted_together_over_the_limit_are_refused_whole() {
    let e = engine_with(EngineConfig {
        num_blocks: 64,
        max_batch_tokens: 2048,
        max_in_flight: 2,
        ..EngineConfig::default()
    });
    let jobs = |n: usize| {
        (0..n)
            .map(|i| job(golden_case(i).0, 4, PrefillSource::Local))
            .collect()
    };
    let err = e
        .generate_all(jobs(3))
        .err()
        .expect("three over a limit of two");
    assert!(
        matches!(err, EngineError::Overloaded { limit: 2, .. }),
        "{err}"
    );
    for g in e.generate_all(jobs(2)).unwrap() {
        let (toks, end) = collect(g).await;
        assert_eq!((toks.len(), end), (4, Ok(FinishReason::Length)));
    }
    wait_idle(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_is_reused_not_recomputed() {
    let e = engine(128);
    let (long, _) = golden_case(2);
    let (_, end) = collect(
        e.generate(job(long.clone(), 2, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert!(end.is_ok());
    let before = e.stats().await.unwrap();
    let mut second = long[..150].to_vec();
    second.extend(tokens(" and the LORD said", true));
    let (_, end) = collect(
        e.generate(job(second.clone(), 2, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert!(end.is_ok());
    let after = e.stats().await.unwrap();
    assert_eq!(
        after.prefill_reused_tokens - before.prefill_reused_tokens,
        128
    );
    assert_eq!(
        after.prefill_computed_tokens - before.prefill_computed_tokens,
        second.len() as u64 - 128
    );
    wait_idle(&e).await;
}

/// Plays the prefill peer: runs a prefill job on `p` and copies each layer's blocks into the
/// decode engine `d` (the in-process equivalent of a transport).
async fn remote_prefill(
    p: &EngineHandle,
    d: &EngineHandle,
    prompt: Vec<u32>,
    dest: Vec<BlockId>,
    skip_tokens: usize,
) -> Result<(u32, u64), String> {
    let d2 = d.clone();
    let landed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = landed.clone();
    let page = p.kv_layout().page_size;
    let first_dest = skip_tokens / page;
    let out = p
        .prefill(
            prompt,
            greedy(),
            skip_tokens,
            Box::new(move |layer, blocks, rows| {
                for (j, b) in blocks.iter().enumerate() {
                    let data = rows.block(*b).map_err(|e| e.to_string())?.to_vec();
                    counted.fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    d2.write_kv(layer, dest[first_dest + j], data)
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            }),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((
        out.first_token,
        landed.load(std::sync::atomic::Ordering::Relaxed),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_gives_the_same_tokens_as_local() {
    let (p, d) = (engine(64), engine(64));
    let (prompt_ids, expected) = golden_case(2);
    let (g, (blocks, cached_tokens)) = common::awaiting_remote(&d, prompt_ids.clone(), 32).await;
    assert_eq!(cached_tokens, 0);
    let (first, bytes) = remote_prefill(&p, &d, prompt_ids, blocks, cached_tokens)
        .await
        .unwrap();
    d.remote_done(g.id, first, bytes).unwrap();
    let (toks, end) = collect(g).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(toks, expected);
    assert_eq!(d.stats().await.unwrap().remote_prefills, 1);
    assert_eq!(
        p.stats().await.unwrap().prefill_computed_tokens,
        golden_case(2).0.len() as u64
    );
    wait_idle(&d).await;
    wait_idle(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_job_ships_the_pool_rows_as_f32_bytes_through_the_view() {
    let e = engine(64);
    let layout = e.kv_layout();
    let (page, width, layers) = (layout.page_size, layout.width, layout.num_layers);
    assert_eq!(e.kv_dtype(), KvDtype::F32);
    let stats = e.stats().await.unwrap();
    assert_eq!(
        stats.kv_host_row_bytes,
        (layers * 64 * page * width * 4) as u64,
        "the CPU engine's pool holds every row in f32"
    );
    assert_eq!(stats.kv_host_staging_bytes, 0, "no staging ring on the CPU");
    let (prompt, _) = golden_case(2);
    type Seen = Vec<(usize, usize, KvDtype, Vec<u8>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let rec = seen.clone();
    e.prefill(
        prompt.clone(),
        greedy(),
        page,
        Box::new(move |layer, blocks, rows: &LayerRows<'_>| {
            let mut v = rec.lock().unwrap();
            for (j, b) in blocks.iter().enumerate() {
                let bytes = rows.block(*b).map_err(|e| e.to_string())?.to_vec();
                v.push((layer, j, rows.dtype(), bytes));
            }
            Ok(())
        }),
    )
    .await
    .unwrap();
    // The same forward on a pool of its own: the job ships exactly those rows' f32 bytes,
    // from the second block on (`skip_tokens` = one block), every layer in order.
    let model = DeepseekModel::load(&ferry_model::embedded::default_model_dir()).unwrap();
    let blocks = prompt.len().div_ceil(page);
    let mut pool = model.new_kv_pool(blocks, page).unwrap();
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: &prompt,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::Last,
        }],
    };
    model.forward(&batch, &mut pool).unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(seen.len(), layers * (blocks - 1), "blocks shipped");
    for (i, (layer, j, dtype, bytes)) in seen.iter().enumerate() {
        assert_eq!((*layer, *j), (i / (blocks - 1), i % (blocks - 1)));
        assert_eq!(*dtype, KvDtype::F32);
        let want: Vec<u8> = pool
            .block(*layer, table[1 + j])
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let valid = (prompt.len() - (1 + j) * page).min(page) * width * 4;
        assert!(
            bytes[..valid] == want[..valid],
            "layer {layer} block {j}: the shipped bytes are the pool's rows"
        );
    }
    wait_idle(&e).await;
}

/// A CPU prefill job's rows come with a lease (a transport reads them in place instead of
/// copying them first): the job's forward returns only after every lease is back, so nothing
/// writes rows a transport is still reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_prefill_job_s_rows_are_leased_until_the_transport_lets_go() {
    use std::time::{Duration, Instant};
    let e = engine(64);
    let layout = e.kv_layout();
    let (prompt, _) = golden_case(2);
    let held: Arc<Mutex<Vec<Lease>>> = Arc::default();
    let keep = held.clone();
    let hook = Box::new(move |_layer, _blocks: &[BlockId], rows: &LayerRows<'_>| {
        let lease = rows
            .host_lease()
            .ok_or("a CPU engine's shipped rows come with a lease")?;
        keep.lock().unwrap().push(lease);
        Ok(())
    });
    // The "transport": once every layer's lease is out, it reads for 200 ms, then lets go.
    let letgo = held.clone();
    let layers = layout.num_layers;
    let reader = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while letgo.lock().unwrap().len() < layers && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(200));
        // The time is taken before the leases go: the forward may return the moment they do,
        // before this thread runs again.
        let letting_go = Instant::now();
        let n = letgo.lock().unwrap().drain(..).count();
        (letting_go, n)
    });
    e.prefill(prompt, greedy(), layout.page_size, hook)
        .await
        .unwrap();
    let returned = Instant::now();
    let (let_go, n) = reader.join().unwrap();
    assert_eq!(n, layers, "one lease per shipped layer");
    assert!(
        let_go <= returned,
        "the prefill returned {:?} before the transport let go of its rows",
        let_go - returned
    );
    wait_idle(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_remote_prefill_recomputes_or_fails_by_policy() {
    let d = engine(64);
    let (prompt_ids, expected) = golden_case(1);
    let remote = PrefillSource::Remote { local_threshold: 0 };

    let mut g = d.generate(job(prompt_ids.clone(), 32, remote)).unwrap();
    assert!(matches!(
        g.events.recv().await,
        Some(EngineEvent::Reserved { .. })
    ));
    d.remote_failed(g.id, true, "peer died".into()).unwrap();
    let (toks, end) = collect(g).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(toks, expected, "recomputed locally");

    let mut g = d.generate(job(prompt_ids, 32, remote)).unwrap();
    assert!(matches!(
        g.events.recv().await,
        Some(EngineEvent::Reserved { .. })
    ));
    d.remote_failed(g.id, false, "peer died".into()).unwrap();
    let (toks, end) = collect(g).await;
    assert!(toks.is_empty());
    assert!(end.unwrap_err().contains("peer died"));
    let s = d.stats().await.unwrap();
    assert_eq!(s.recomputed_prefills, 1);
    wait_idle(&d).await;
}

/// A remote prefill this side stopped waiting for (its peer may still be writing, and a
/// one-sided put cannot be refused on arrival): the peer's blocks are quarantined, the
/// recompute runs on fresh blocks, a late write into the quarantined rows changes nothing, and
/// the blocks come back once the peer has settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_remote_prefill_quarantines_its_blocks_until_the_peer_settles() {
    let d = engine(64);
    let (prompt_ids, expected) = golden_case(1);
    let remote = PrefillSource::Remote { local_threshold: 0 };
    let mut g = d.generate(job(prompt_ids.clone(), 32, remote)).unwrap();
    let reserved = match g.events.recv().await {
        Some(EngineEvent::Reserved {
            blocks,
            cached_tokens: 0,
        }) => blocks,
        other => panic!("expected a reservation, got {other:?}"),
    };
    let fences = d.remote_fences();
    assert!(reserved.iter().all(|b| fences.holds(b.0, g.id.0)));
    let id = g.id;
    d.remote_abandoned(id, true, "prefill peer timed out".into())
        .unwrap();
    let (toks, end) = collect(g).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(toks, expected, "recomputed locally");
    assert!(
        reserved.iter().all(|b| !fences.holds(b.0, id.0)),
        "the fence is lifted: a writer that is seen is refused"
    );
    let s = d.stats().await.unwrap();
    assert_eq!(
        s.kv_blocks_used,
        reserved.len(),
        "only the quarantined blocks are held"
    );

    // The late peer's puts land in the quarantined rows: garbage, in every layer.
    let rows = d.host_rows().expect("a CPU engine's rows");
    let block_bytes = d.kv_layout().block_floats() * 4;
    for layer in 0..rows.num_layers() {
        let (base, len) = rows.layer_span(layer).unwrap();
        for b in &reserved {
            let at = b.0 as usize * block_bytes;
            assert!(at + block_bytes <= len);
            // SAFETY: in range of the layer's allocation; the blocks are quarantined, so
            // nothing in the engine reads or writes them (as for a real one-sided put).
            unsafe { std::ptr::write_bytes(base.add(at), 0x7f, block_bytes) };
        }
    }
    // The same prompt again reuses the recomputed (cached) blocks, not the quarantined ones.
    let (toks, _) = collect(
        d.generate(job(prompt_ids, 32, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert_eq!(toks, expected, "the late write reached no live block");

    d.remote_settled(id).unwrap();
    wait_idle(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_uncached_prompts_prefill_locally() {
    let d = engine(64);
    let mut g = d
        .generate(job(
            tokens("And God said", true),
            4,
            PrefillSource::Remote {
                local_threshold: 32,
            },
        ))
        .unwrap();
    assert!(matches!(
        g.events.recv().await,
        Some(EngineEvent::LocalPrefill { .. })
    ));
    let (toks, _) = collect(g).await;
    assert_eq!(toks.len(), 4);
    wait_idle(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_cancels_and_frees() {
    let d = engine(64);
    let mut g = d
        .generate(job(golden_case(2).0, 500, PrefillSource::Local))
        .unwrap();
    loop {
        if let Some(EngineEvent::Token(_)) = g.events.recv().await {
            break;
        }
    }
    drop(g);
    wait_idle(&d).await;
    // A fresh request still runs after the cancellation.
    let (toks, _) = collect(
        d.generate(job(tokens("And", true), 3, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert_eq!(toks.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_cannot_fit_fails_alone() {
    // 4 blocks of 64 = 256 positions: the 211-token prompt + 100 new tokens cannot fit, a small
    // request next to it can.
    let d = engine(4);
    let big = d
        .generate(job(golden_case(2).0, 100, PrefillSource::Local))
        .unwrap();
    let small = d
        .generate(job(tokens("And", true), 3, PrefillSource::Local))
        .unwrap();
    let (_, end) = collect(big).await;
    assert!(end.unwrap_err().contains("out of KV blocks"));
    let (toks, end) = collect(small).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(toks.len(), 3);
    wait_idle(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_request_continues_exactly_where_the_first_run_stopped() {
    // Request migration: prompt + the first k tokens, `resumed_tokens = k`, must give the
    // rest of the uninterrupted run, greedy and seeded (the seeded stream of step i depends on
    // (seed, i) only), with `max_tokens` counting the k tokens.
    use ferry_kernels::cpu::sample::SamplingParams;
    use ferry_model::engine::GenerateOptions;
    let e = engine(128);
    let (prompt, _) = golden_case(1);
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(11),
        ..SamplingParams::default()
    };
    for (what, sampling) in [("greedy", greedy()), ("seeded", seeded)] {
        const N: usize = 40;
        let mut whole = job(prompt.clone(), N, PrefillSource::Local);
        whole.sampling = sampling.clone();
        let (want, end) = collect(e.generate(whole).unwrap()).await;
        assert_eq!(end, Ok(FinishReason::Length), "{what}");
        assert_eq!(want.len(), N, "{what}");
        for k in [1, 17, N - 1] {
            let mut resumed_prompt = prompt.clone();
            resumed_prompt.extend_from_slice(&want[..k]);
            let mut rest = job(resumed_prompt, N, PrefillSource::Local);
            rest.sampling = sampling.clone();
            let options = GenerateOptions {
                resumed_tokens: k,
                ..GenerateOptions::default()
            };
            let (got, end) = collect(e.generate_with(rest, options).unwrap()).await;
            assert_eq!(end, Ok(FinishReason::Length), "{what}, k = {k}");
            assert_eq!(got, want[k..], "{what}: resumed after {k} tokens");
        }
    }
    wait_idle(&e).await;
}
