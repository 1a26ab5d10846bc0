//! Cache-aware routing across real processes: a request sharing a cached prefix goes to the
//! prefill worker that holds it, which computes only the tokens past the cached whole blocks.
//!
//! The policy breaks cost ties by worker id, so the test makes the cache the only reason to
//! pick the holder: request A runs while `prefill-b` is the only prefill worker, then
//! `prefill-a` (which wins every tie) joins. Request B (A's text plus a sentence) must still go
//! to `prefill-b`. A cache-blind router would send it to `prefill-a`.
mod cluster;

use std::time::Duration;

use cluster::{Cluster, Role, Spec, PAGE};

const MAX_TOKENS: u32 = 16;

#[tokio::test]
async fn a_shared_prefix_is_routed_to_its_holder_and_only_the_rest_is_computed() {
    let a_text = cluster::long_prompt();
    let b_text = format!("{a_text} Blessed are they that mourn: for they shall be comforted.");
    let b_ref = cluster::reference_generate(&b_text, MAX_TOKENS).await;

    // Decode always asks a prefill worker (threshold 0); default policy: cache_aware.
    let mut cluster =
        Cluster::start(Spec::new(0, 1).decode(&["--local-prefill-threshold", "0"])).await;
    let decode = cluster.live(Role::Decode)[0].clone();
    cluster.add_worker(Role::Prefill, "prefill-b").await;

    let (a_ids, b_ids) = (
        cluster::tokens(&cluster, &a_text).await,
        cluster::tokens(&cluster, &b_text).await,
    );
    let shared = a_ids.iter().zip(&b_ids).take_while(|(x, y)| x == y).count();
    let reusable = shared / PAGE * PAGE;
    assert!(reusable >= 3 * PAGE, "A and B share {shared} tokens");

    let mut client = cluster.grpc().await;
    let a = cluster::generate(&mut client, cluster::greedy_request(&a_text, MAX_TOKENS))
        .await
        .expect("request A");
    assert_eq!(a.token_ids.len(), MAX_TOKENS as usize);
    let holder = cluster.stats("prefill-b").await;
    assert_eq!(
        holder.prefill_computed_tokens,
        a_ids.len() as u64,
        "{holder:?}"
    );
    assert_eq!(holder.prefill_reused_tokens, 0, "{holder:?}");
    // A's whole blocks stay in prefill-b's prefix cache; the worker publishes them to the
    // router with its next heartbeat (every 50 ms), long before the next worker has started.
    let holder = cluster
        .wait_stats(
            "prefill-b",
            Duration::from_secs(10),
            "holding A's blocks",
            |s| s.kv_blocks_used == 0 && s.kv_blocks_cached as usize >= a_ids.len() / PAGE,
        )
        .await;

    cluster.add_worker(Role::Prefill, "prefill-a").await;
    let other = cluster.stats("prefill-a").await;

    let b = cluster::generate(&mut client, cluster::greedy_request(&b_text, MAX_TOKENS))
        .await
        .expect("request B");
    assert_eq!(b.text, b_ref, "B over a reused prefix vs ferry generate");

    let holder_after = cluster.stats("prefill-b").await;
    let other_after = cluster.stats("prefill-a").await;
    assert_eq!(
        (
            other_after.prefill_computed_tokens,
            other_after.prefill_reused_tokens,
            other_after.kv_transfer_bytes
        ),
        (
            other.prefill_computed_tokens,
            other.prefill_reused_tokens,
            other.kv_transfer_bytes
        ),
        "B must not go to prefill-a, which holds nothing of it: {other_after:?}"
    );
    assert_eq!(
        holder_after.prefill_reused_tokens - holder.prefill_reused_tokens,
        reusable as u64,
        "prefill-b reuses A's {} whole blocks: {holder_after:?}",
        reusable / PAGE
    );
    assert_eq!(
        holder_after.prefill_computed_tokens - holder.prefill_computed_tokens,
        (b_ids.len() - reusable) as u64,
        "prefill-b computes only B's tokens past the cached blocks: {holder_after:?}"
    );
    let d = cluster.stats(&decode).await;
    assert_eq!(
        (d.remote_prefills, d.local_prefills, d.recomputed_prefills),
        (2, 0, 0),
        "{d:?}"
    );

    cluster.assert_kv_blocks_released().await;
}
