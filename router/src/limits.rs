//! Per-API-key limits: `max_concurrent` (a semaphore) and `tokens_per_minute` (a `governor`
//! GCRA bucket), checked at admission by both front doors.
//!
//! ```text
//! Caller::admit()            before validation: one of the key's max_concurrent slots,
//!                            none free → KeyConcurrency (429, Retry-After 1 s)
//! validate                   prompt tokens and max_tokens become known
//! Caller::charge(valid)      prompt tokens + max_tokens from the key's bucket:
//!                            more than the whole per-minute budget → OverKeyBudget (400, never passes)
//!                            not enough now → KeyRate (429, Retry-After = the bucket's wait)
//! dispatcher.generate        the router's own max_concurrent_requests (Overloaded, 429)
//! Admission::hold(stream)    the slot is held by the response stream and freed when it ends
//!                            or the client goes away
//! ```
//!
//! Tokens are charged at admission, for the most the request can use (prompt + `max_tokens`,
//! where an unset `max_tokens` is what the context leaves, see `validate.rs`), because the
//! bucket must decide before any work is done; what a request did not use is not refunded,
//! nor are the tokens of a request the router refuses after the charge (overload, no worker).
//! Clients that want their budget to go further send a small `max_tokens`. The bucket holds a
//! whole minute's budget, so a key idle for a minute may spend it at once, and refills evenly
//! (`tokens_per_minute` / 60 per second).
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;

use futures::StreamExt as _;
use governor::clock::Clock as _;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::Caller;
use crate::dispatch::GenerationStream;
use crate::error::RequestError;
use crate::validate::ValidRequest;

/// The limits a keys-file line asks for; `None` is no per-key limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSpec {
    /// `max_concurrent=`.
    pub max_concurrent: Option<NonZeroUsize>,
    /// `tokens_per_minute=`.
    pub tokens_per_minute: Option<NonZeroU32>,
}

/// One key's live limits.
pub struct KeyLimits {
    name: String,
    concurrency: Option<(Arc<Semaphore>, usize)>,
    tokens: Option<(DefaultDirectRateLimiter, NonZeroU32)>,
}

impl std::fmt::Debug for KeyLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyLimits")
            .field("name", &self.name)
            .field("max_concurrent", &self.max_concurrent())
            .field("in_flight", &self.in_flight())
            .field("tokens_per_minute", &self.tokens_per_minute())
            .finish()
    }
}

impl KeyLimits {
    /// The limits of the key named `name` (for error messages).
    pub fn new(name: &str, spec: LimitSpec) -> Self {
        Self {
            name: name.to_string(),
            concurrency: spec
                .max_concurrent
                .map(|n| (Arc::new(Semaphore::new(n.get())), n.get())),
            tokens: spec
                .tokens_per_minute
                .map(|n| (RateLimiter::direct(Quota::per_minute(n)), n)),
        }
    }

    /// `max_concurrent`, if set.
    pub fn max_concurrent(&self) -> Option<usize> {
        self.concurrency.as_ref().map(|(_, n)| *n)
    }

    /// `tokens_per_minute`, if set.
    pub fn tokens_per_minute(&self) -> Option<u32> {
        self.tokens.as_ref().map(|(_, n)| n.get())
    }

    /// Requests of this key in flight now.
    pub fn in_flight(&self) -> usize {
        self.concurrency
            .as_ref()
            .map_or(0, |(s, n)| n - s.available_permits())
    }

    fn admit(&self) -> Result<Admission, RequestError> {
        let Some((slots, limit)) = &self.concurrency else {
            return Ok(Admission(None));
        };
        slots
            .clone()
            .try_acquire_owned()
            .map(|permit| Admission(Some(permit)))
            .map_err(|_| RequestError::KeyConcurrency {
                key: self.name.clone(),
                limit: *limit,
            })
    }

    fn charge(&self, cost: u64) -> Result<(), RequestError> {
        let Some((bucket, per_minute)) = &self.tokens else {
            return Ok(());
        };
        let over_budget = || RequestError::OverKeyBudget {
            key: self.name.clone(),
            per_minute: per_minute.get(),
            cost,
        };
        let n = u32::try_from(cost)
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(over_budget)?;
        match bucket.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(RequestError::KeyRate {
                key: self.name.clone(),
                per_minute: per_minute.get(),
                cost,
                retry_after: not_until.wait_time_from(bucket.clock().now()),
            }),
            Err(_insufficient) => Err(over_budget()),
        }
    }
}

/// A request's hold on its key's `max_concurrent` slot (nothing when the key has none).
#[derive(Debug)]
#[must_use = "dropping the admission frees the slot"]
pub struct Admission(Option<OwnedSemaphorePermit>);

impl Admission {
    /// Makes `stream` own the slot: it is freed when the stream ends or is dropped.
    pub fn hold(self, stream: GenerationStream) -> GenerationStream {
        match self.0 {
            None => stream,
            Some(permit) => Box::pin(stream.map(move |item| {
                let _held = &permit;
                item
            })),
        }
    }
}

impl Caller {
    /// Takes one of the key's `max_concurrent` slots (call before validation: a refused
    /// request costs no tokenization).
    pub fn admit(&self) -> Result<Admission, RequestError> {
        match self {
            Self::Anonymous => Ok(Admission(None)),
            Self::Key(key) => key.limits().admit(),
        }
    }

    /// Charges `req`'s prompt tokens + `n × max_tokens` (each sample may generate
    /// `max_tokens`) to the key's `tokens_per_minute`.
    pub fn charge(&self, req: &ValidRequest) -> Result<(), RequestError> {
        match self {
            Self::Anonymous => Ok(()),
            Self::Key(key) => {
                let cost =
                    req.prompt().len() as u64 + u64::from(req.n()) * u64::from(req.max_tokens());
                key.limits().charge(cost)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_concurrent: Option<usize>, tokens_per_minute: Option<u32>) -> KeyLimits {
        KeyLimits::new(
            "k",
            LimitSpec {
                max_concurrent: max_concurrent.and_then(NonZeroUsize::new),
                tokens_per_minute: tokens_per_minute.and_then(NonZeroU32::new),
            },
        )
    }

    #[test]
    fn concurrency_slots_are_freed_by_drop() {
        let l = limits(Some(2), None);
        let a = l.admit().expect("first");
        let _b = l.admit().expect("second");
        assert_eq!(l.in_flight(), 2);
        let e = l.admit().expect_err("third");
        assert_eq!(e.kind(), "concurrency_limited");
        assert_eq!(e.retry_after_secs(), Some(1));
        assert!(e.to_string().contains("API key `k`"), "{e}");
        drop(a);
        let _c = l.admit().expect("a slot was freed");
    }

    #[test]
    fn a_held_stream_keeps_the_slot_until_dropped() {
        let l = limits(Some(1), None);
        let stream: GenerationStream = Box::pin(futures::stream::pending());
        let held = l.admit().expect("slot").hold(stream);
        assert!(l.admit().is_err());
        drop(held);
        assert!(l.admit().is_ok());
    }

    #[test]
    fn the_token_bucket_refuses_with_a_wait_and_never_for_too_big() {
        let l = limits(None, Some(600)); // refills 10 tokens per second
        l.charge(500).expect("within the budget");
        let e = l.charge(200).expect_err("100 left");
        assert_eq!(e.kind(), "rate_limited");
        let secs = e.retry_after_secs().expect("a wait");
        // 100 more tokens at 10/s: about 10 s (less the time this test took).
        assert!((9..=10).contains(&secs), "{secs}");
        let e = l.charge(601).expect_err("above the whole budget");
        assert_eq!(e.kind(), "exceeds_key_budget");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.retry_after_secs(), None);
        assert!(limits(None, None).charge(u64::MAX).is_ok());
    }
}
