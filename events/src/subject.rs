//! The events plane's address space. Worker and router ids are hex-encoded into one subject
//! token, so any id (dots, spaces, `*`, `>`) is a valid, unambiguous subject.

/// The JetStream stream holding every worker's KV snapshots and events.
pub const KV_STREAM: &str = "FERRY_KV";

/// The stream's subjects: `ferry.kv.<worker>`.
pub const KV_ALL: &str = "ferry.kv.*";

/// Every worker's heartbeats: `ferry.hb.<role>.<worker>`.
pub const HEARTBEAT_ALL: &str = "ferry.hb.*.*";

/// Every router's predictive load: `ferry.load.<router>`.
pub const ROUTER_LOAD_ALL: &str = "ferry.load.*";

/// The KV stream subject of `worker`.
pub fn kv(worker: &str) -> String {
    format!("ferry.kv.{}", token(worker))
}

/// The heartbeat subject of `worker` in `role` (`"prefill"` or `"decode"`).
pub fn heartbeat(role: &str, worker: &str) -> String {
    format!("ferry.hb.{role}.{}", token(worker))
}

/// Heartbeats of every worker of `role`.
pub fn heartbeats_of(role: &str) -> String {
    format!("ferry.hb.{role}.*")
}

/// Where a router asks `worker` for a fresh snapshot on the KV stream.
pub fn snapshot_request(worker: &str) -> String {
    format!("ferry.ctl.snapshot.{}", token(worker))
}

/// Where `router` publishes its predictive load.
pub fn router_load(router: &str) -> String {
    format!("ferry.load.{}", token(router))
}

/// An id as one subject token: lowercase hex of its UTF-8 bytes.
pub fn token(id: &str) -> String {
    id.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The id a [`token`] encodes; `None` if it is not one.
pub fn id_of(token: &str) -> Option<String> {
    if token.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_one_token() {
        for id in ["decode-0", "a.b", "x y", "*", ">", "ünï"] {
            let t = token(id);
            assert!(t.bytes().all(|b| b.is_ascii_hexdigit()), "{t}");
            assert_eq!(id_of(&t).as_deref(), Some(id));
        }
        assert_eq!(id_of("abc"), None);
        assert_eq!(id_of("zz"), None);
        assert_eq!(kv("d.0"), "ferry.kv.642e30");
        assert_eq!(heartbeat("prefill", "p"), "ferry.hb.prefill.70");
    }
}
