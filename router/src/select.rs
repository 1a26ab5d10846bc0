//! [`Selector`]: decides where a request goes and charges the predictive load.
//!
//! Reads a copy of the healthy workers from the registry and the prompt's overlaps from the
//! index, runs the configured [`Policy`] (pure), and returns the chosen workers with a
//! [`LoadGuard`] holding the request's predicted load on them. Sending is the dispatcher's job.
use std::time::Instant;

use ferry_proto::auth::AttachToken;
use ferry_proto::ids::{BlockHash, WorkerId};
use ferry_proto::internal::decode_worker_client::DecodeWorkerClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::error::RequestError;
use crate::index::Overlaps;
use crate::load::{Charge, LoadGuard};
use crate::policy::{Candidate, Decision, Policy, SelectInput, SelectPolicy};
use crate::registry::{Registry, Role, Transports, WorkerSnapshot};

/// The prompt to place.
#[derive(Debug, Clone, Copy)]
pub struct SelectRequest<'a> {
    /// Chained hashes of the prompt's full blocks.
    pub hashes: &'a [BlockHash],
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Decode workers not to use (they already failed this request).
    pub exclude: &'a [WorkerId],
    /// Prefill on the decode worker, whatever the policy would choose (a migrated request:
    /// a prefill peer would sample its first token at step 0).
    pub prefill_here: bool,
}

/// The chosen decode worker.
#[derive(Debug, Clone)]
pub struct DecodeTarget {
    /// Its id.
    pub id: WorkerId,
    /// Its gRPC address as registered (to mark exactly this registration down).
    pub grpc_address: String,
    /// A channel to it.
    pub channel: Channel,
    /// Signs calls to it with the cluster token.
    pub auth: AttachToken,
}

impl DecodeTarget {
    /// A `DecodeWorker` client over the worker's channel, signing every call.
    pub fn decode_client(&self) -> DecodeWorkerClient<InterceptedService<Channel, AttachToken>> {
        DecodeWorkerClient::with_interceptor(self.channel.clone(), self.auth.clone())
    }
}

/// The chosen prefill worker, as the decode worker will be told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillTarget {
    /// Its id.
    pub id: WorkerId,
    /// Its gRPC address as registered.
    pub grpc_address: String,
}

/// The outcome of one selection.
#[derive(Debug)]
pub struct Selection {
    /// What the policy decided.
    pub decision: Decision,
    /// Where to send the request.
    pub decode: DecodeTarget,
    /// Who prefills, if not the decode worker itself.
    pub prefill: Option<PrefillTarget>,
    /// The request's predicted load on both; released as the request progresses.
    pub guard: LoadGuard,
}

/// Runs the policy over the registry's current state.
#[derive(Debug)]
pub struct Selector {
    registry: Registry,
    policy: Policy,
    ttft_slo_ms: Option<u64>,
}

impl Selector {
    /// A selector over `registry` using `policy`.
    pub fn new(registry: Registry, policy: Policy) -> Self {
        Self {
            registry,
            policy,
            ttft_slo_ms: None,
        }
    }

    /// Rejects requests whose estimated TTFT (from policies that estimate one) exceeds
    /// `slo_ms`, before any load is charged.
    pub fn with_ttft_slo(self, slo_ms: Option<u64>) -> Self {
        Self {
            ttft_slo_ms: slo_ms,
            ..self
        }
    }

    /// The registry it reads.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The configured policy.
    pub fn policy_kind(&self) -> crate::config::PolicyKind {
        self.policy.kind()
    }

    /// `decision`, unless its prefill worker speaks none of its decode worker's transports
    /// (one started with `--transport ucx`, the other without): then the policy chooses again
    /// among the prefill workers that can write to that decode worker, or prefills on the
    /// decode worker when none can, and says so in the log.
    fn reachable(
        &self,
        decision: Decision,
        input: &SelectInput<'_>,
        workers: &[WorkerSnapshot],
    ) -> Decision {
        let speaks = |id: &WorkerId| {
            workers
                .iter()
                .find(|w| &w.id == id)
                .map_or(Transports::TCP, |w| w.transports)
        };
        let Some(p) = &decision.prefill else {
            return decision;
        };
        let wanted = speaks(&decision.decode);
        if speaks(p).meets(wanted) {
            return decision;
        }
        let prefill: Vec<Candidate> = input
            .prefill
            .iter()
            .filter(|c| speaks(&c.id).meets(wanted))
            .cloned()
            .collect();
        let decode: Vec<Candidate> = input
            .decode
            .iter()
            .filter(|c| c.id == decision.decode)
            .cloned()
            .collect();
        let again = SelectInput {
            prefill: &prefill,
            decode: &decode,
            ..*input
        };
        let retry = self.policy.select(&again);
        tracing::warn!(
            decode = %decision.decode,
            transports = %wanted,
            skipped = %p,
            chosen = ?retry.as_ref().and_then(|d| d.prefill.as_ref()).map(|p| p.0.as_str()),
            "no shared KV transport between the chosen prefill and decode workers; re-paired"
        );
        retry.unwrap_or(Decision {
            prefill: None,
            ..decision
        })
    }

    /// Picks the pair for `req` and charges its load. [`RequestError::NoDecodeWorker`] when
    /// no healthy, non-excluded decode worker exists.
    pub fn select(&self, req: &SelectRequest<'_>) -> Result<Selection, RequestError> {
        let workers = self.registry.healthy_workers(Instant::now());
        // While the events plane that feeds the index is down, route by load alone.
        let overlaps = if self.registry.index_trusted() {
            self.registry.index().overlaps(req.hashes)
        } else {
            Overlaps::default()
        };
        let candidates = |role: Role| -> Vec<Candidate> {
            workers
                .iter()
                .filter(|w| {
                    w.role == role && !(role == Role::Decode && req.exclude.contains(&w.id))
                })
                .map(|w| Candidate {
                    id: w.id.clone(),
                    load: w.load,
                    pending: w.pending,
                })
                .collect()
        };
        let prefill = if req.prefill_here {
            Vec::new()
        } else {
            candidates(Role::Prefill)
        };
        let decode = candidates(Role::Decode);
        let input = SelectInput {
            prompt_tokens: req.prompt_tokens,
            page_size: self.registry.page_size(),
            prefill: &prefill,
            decode: &decode,
            overlaps: &overlaps,
        };
        let mut decision = self
            .policy
            .select(&input)
            .ok_or(RequestError::NoDecodeWorker)?;
        decision = self.reachable(decision, &input, &workers);
        if let (Some(slo_ms), Some(estimated_ms)) = (self.ttft_slo_ms, decision.estimated_ttft_ms) {
            if estimated_ms > slo_ms {
                return Err(RequestError::TtftSlo {
                    estimated_ms,
                    slo_ms,
                });
            }
        }
        let find = |id: &WorkerId| -> Result<&WorkerSnapshot, RequestError> {
            workers.iter().find(|w| &w.id == id).ok_or_else(|| {
                RequestError::Internal(format!("policy chose `{id}`, which is not a candidate"))
            })
        };
        let d = find(&decision.decode)?;
        let p = decision.prefill.as_ref().map(find).transpose()?;

        let prompt_blocks = input.prompt_blocks();
        let decode_charge = Charge {
            prefill_blocks: if p.is_none() {
                input.uncached_blocks(&d.id)
            } else {
                0
            },
            active_blocks: prompt_blocks,
        };
        let prefill_charge = p.map(|p| {
            (
                p.pending_handle.clone(),
                Charge {
                    prefill_blocks: input.uncached_blocks(&p.id),
                    active_blocks: 0,
                },
            )
        });
        let guard = LoadGuard::new((d.pending_handle.clone(), decode_charge), prefill_charge);
        Ok(Selection {
            decode: DecodeTarget {
                id: d.id.clone(),
                grpc_address: d.grpc_address.clone(),
                channel: d.channel.clone(),
                auth: d.auth.clone(),
            },
            prefill: p.map(|p| PrefillTarget {
                id: p.id.clone(),
                grpc_address: p.grpc_address.clone(),
            }),
            decision,
            guard,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use ferry_proto::ids::EventId;

    use super::*;
    use crate::config::PolicyKind;
    use crate::index::{FlatIndex, Snapshot};
    use crate::registry::{Registration, RegistryParams, Transports};

    fn registry() -> Registry {
        registry_speaking(&[])
    }

    /// The test registry, with `transports` overriding a worker's (default: TCP).
    fn registry_speaking(transports: &[(&str, &[&str])]) -> Registry {
        let r = Registry::new(RegistryParams {
            index: Arc::new(FlatIndex::new()),
            heartbeat_timeout: Duration::from_secs(60),
            page_size: 4,
            cluster_token: None,
        });
        for (id, role, blocks) in [
            ("p0", Role::Prefill, vec![]),
            ("p1", Role::Prefill, vec![1, 2, 3]),
            ("d0", Role::Decode, vec![]),
            ("d1", Role::Decode, vec![]),
        ] {
            r.register(
                Registration {
                    id: WorkerId::from(id),
                    role,
                    grpc_address: "127.0.0.1:1".into(),
                    page_size: 4,
                    total_blocks: 100,
                    snapshot: Snapshot {
                        blocks: blocks.into_iter().map(BlockHash).collect(),
                        last_event: EventId(0),
                    },
                    instance: 1,
                    transports: transports
                        .iter()
                        .find(|(w, _)| *w == id)
                        .map(|(_, names)| {
                            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
                            Transports::parse(&names).expect("known names")
                        })
                        .unwrap_or(Transports::TCP),
                },
                Instant::now(),
            )
            .expect("valid registration");
        }
        r
    }

    #[tokio::test]
    async fn a_prefill_worker_is_paired_only_with_decode_workers_it_can_write_to() {
        let hashes: Vec<BlockHash> = [1, 2, 3].into_iter().map(BlockHash).collect();
        let req = |exclude| SelectRequest {
            hashes: &hashes,
            prompt_tokens: 16,
            exclude,
            prefill_here: false,
        };
        // p1 holds the prefix but speaks only TCP; d0 and d1 receive over UCX; p0 speaks both.
        let speaking: [(&str, &[&str]); 3] =
            [("p0", &["tcp", "ucx"]), ("d0", &["ucx"]), ("d1", &["ucx"])];
        let selector = Selector::new(
            registry_speaking(&speaking),
            Policy::new(PolicyKind::CacheAware),
        );
        let s = selector.select(&req(&[])).expect("selection");
        assert_eq!(s.prefill.as_ref().map(|p| p.id.0.as_str()), Some("p0"));
        // With no prefill worker speaking UCX, the decode worker prefills itself.
        let speaking: [(&str, &[&str]); 2] = [("d0", &["ucx"]), ("d1", &["ucx"])];
        let selector = Selector::new(
            registry_speaking(&speaking),
            Policy::new(PolicyKind::CacheAware),
        );
        let s = selector.select(&req(&[])).expect("selection");
        assert!(s.prefill.is_none(), "prefilled on {}", s.decode.id.0);
        // Unknown names are refused at registration, naming the field.
        let e = Transports::parse(&["rdma".into()]).unwrap_err();
        assert!(e.to_string().contains("transports"), "{e}");
    }

    #[tokio::test]
    async fn selection_uses_the_index_and_charges_load_until_dropped() {
        let selector = Selector::new(registry(), Policy::new(PolicyKind::CacheAware));
        let hashes: Vec<BlockHash> = [1, 2, 3].into_iter().map(BlockHash).collect();
        let req = SelectRequest {
            hashes: &hashes,
            prompt_tokens: 16,
            exclude: &[],
            prefill_here: false,
        };
        let s = selector.select(&req).expect("selection");
        assert_eq!(s.prefill.as_ref().map(|p| p.id.0.as_str()), Some("p1"));
        assert_eq!(s.decision.predicted_cached_blocks, 3);
        let pending = |id: &str| {
            selector
                .registry()
                .healthy_workers(Instant::now())
                .into_iter()
                .find(|w| w.id.0 == id)
                .map(|w| w.pending)
                .expect("worker")
        };
        assert_eq!(pending("p1").prefill_blocks, 1, "4 blocks, 3 cached");
        assert_eq!(pending(&s.decode.id.0).active_blocks, 4);

        let excluded = [s.decode.id.clone()];
        let retry = selector
            .select(&SelectRequest {
                exclude: &excluded,
                ..req
            })
            .expect("the other decode worker");
        assert_ne!(retry.decode.id, s.decode.id);
        drop((s, retry));
        for w in ["p0", "p1", "d0", "d1"] {
            assert_eq!(pending(w), Default::default(), "{w}: load released");
        }

        let here = selector
            .select(&SelectRequest {
                prefill_here: true,
                ..req
            })
            .expect("a decode worker");
        assert!(here.prefill.is_none(), "prefilled on the decode worker");
        drop(here);

        let both = [WorkerId::from("d0"), WorkerId::from("d1")];
        let none = selector.select(&SelectRequest {
            exclude: &both,
            ..req
        });
        assert!(matches!(none, Err(RequestError::NoDecodeWorker)));
    }
}
