//! API keys of the public plane: the keys file, parsed once into [`ApiKeys`], and the
//! [`Caller`] each request is authenticated as.
//!
//! ```text
//! --api-keys-file PATH ──ApiKeys::load──> digest → ApiKey { name, limits }    (start-up; errors name line + field)
//! `authorization: Bearer <key>` ──ApiKeys::authenticate──> Caller::Key(ApiKey) | AuthError
//!   keys off (no file) ─────────────────────────────────> Caller::Anonymous   (no limits but the router's own)
//! ```
//!
//! Keys are never stored or compared as text: the file's keys are kept as SHA-256 digests, and
//! a presented key is hashed and looked up by its digest, so the time a lookup takes does not
//! depend on how many leading characters of a real key were guessed. Only a key's `name`
//! reaches logs, spans and error messages.
//!
//! Who checks: `http/auth.rs` on `/v1/*` (`/health` and `/metrics` stay open) and `grpc.rs` on
//! every `ferry.v1.Inference` call (gRPC health and reflection stay open). The per-key limits
//! live in [`crate::limits`].
//!
//! # The keys file
//!
//! ```text
//! # Lines whose first non-blank character is `#` are comments; blank lines are ignored.
//! 3f9c0e6b1d2a47c8b5e4f60a9d1c2b3e name=alice max_concurrent=4 tokens_per_minute=200000
//! 77aa01bc93de45f0a1b2c3d4e5f60718 name=batch-jobs                # a field starting with `#` begins a comment
//! c0ffee00c0ffee00c0ffee00c0ffee00
//! ```
//!
//! Each line is the key, then optional `field=value`s separated by blanks, each at most once:
//!
//! | field | value | unset |
//! |---|---|---|
//! | (first) the key | 16 to 256 visible ASCII characters (`!` to `~`), not starting with `#` | required |
//! | `name` | 1 to 64 of `A-Z a-z 0-9 . _ -`; unique in the file; what logs and errors show | `line-N` (its line number) |
//! | `max_concurrent` | requests of this key in flight at once, 1 to [`MAX_CONCURRENT`] | no per-key limit |
//! | `tokens_per_minute` | prompt + `max_tokens` tokens admitted per minute, 1 to 4294967295 | no per-key limit |
//!
//! A key may appear once. A file with no key is an error (an empty file would otherwise lock
//! everyone out, or be mistaken for keys off).
use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::limits::{KeyLimits, LimitSpec};

/// The most `max_concurrent` a key may have (tokio's semaphore limit).
pub const MAX_CONCURRENT: usize = tokio::sync::Semaphore::MAX_PERMITS;

/// Shortest key accepted: 16 characters (a 64-bit random hex key).
pub const MIN_KEY_LEN: usize = 16;

/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 256;

/// Longest key name.
pub const MAX_NAME_LEN: usize = 64;

/// A key's SHA-256 digest, the only form in which keys are kept.
type KeyDigest = [u8; 32];

fn digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

/// One API key's identity and limits (the key itself is not kept).
#[derive(Debug)]
pub struct ApiKey {
    name: String,
    limits: KeyLimits,
}

impl ApiKey {
    /// The key's name, safe to log.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its per-key limits.
    pub fn limits(&self) -> &KeyLimits {
        &self.limits
    }
}

/// Who a request is authenticated as.
#[derive(Debug, Clone)]
pub enum Caller {
    /// API keys are off: anyone, bound only by the router's own limits.
    Anonymous,
    /// A valid key.
    Key(Arc<ApiKey>),
}

impl Caller {
    /// The key's name; `None` when keys are off.
    pub fn key_name(&self) -> Option<&str> {
        match self {
            Self::Anonymous => None,
            Self::Key(key) => Some(key.name()),
        }
    }

    /// Puts the key's name (never the key) on the request span: the exported attribute
    /// `ferry.api_key.name`, and a debug event in the span for the logs.
    pub fn record(&self, span: &tracing::Span) {
        if let Some(name) = self.key_name() {
            ferry_proto::trace_ctx::set_attribute(span, "ferry.api_key.name", name.to_string());
            tracing::debug!(parent: span, api_key = name, "authenticated");
        }
    }
}

/// Why a request was not authenticated. The messages never echo what was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `authorization` header / metadata.
    #[error("no API key: send it as `authorization: Bearer <key>`")]
    Missing,
    /// `authorization` is not `Bearer <key>`.
    #[error("malformed `authorization`: expected `Bearer <key>`")]
    Malformed,
    /// The key is not in the keys file.
    #[error("invalid API key")]
    Unknown,
}

/// The API keys of one router: off, or the keys of one file.
#[derive(Debug, Default)]
pub struct ApiKeys {
    /// `None`: keys are off.
    by_digest: Option<HashMap<KeyDigest, Arc<ApiKey>>>,
}

impl ApiKeys {
    /// Keys off: every request is [`Caller::Anonymous`].
    pub fn off() -> Self {
        Self::default()
    }

    /// Off for `None`, else the keys of `path` (read once; restart the router to change them).
    pub fn load(path: Option<&Path>) -> Result<Self, KeysFileError> {
        let Some(path) = path else {
            return Ok(Self::off());
        };
        let text = std::fs::read_to_string(path).map_err(|source| KeysFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of a keys file (see the module docs); `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, KeysFileError> {
        let mut by_digest = HashMap::new();
        let mut lines_of: HashMap<KeyDigest, usize> = HashMap::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let invalid = |field: &'static str, message: String| KeysFileError::Invalid {
                path: path.to_path_buf(),
                line,
                field,
                message,
            };
            let Some(entry) = parse_line(raw, line).map_err(|(f, m)| invalid(f, m))? else {
                continue;
            };
            let digest = digest(entry.key.as_bytes());
            if let Some(first) = lines_of.insert(digest, line) {
                return Err(invalid(
                    "key",
                    format!("must be unique, but line {first} has the same key"),
                ));
            }
            if let Some(first) = names.insert(entry.name.clone(), line) {
                return Err(invalid(
                    "name",
                    format!("must be unique, but line {first} is also `{}`", entry.name),
                ));
            }
            let key = ApiKey {
                limits: KeyLimits::new(&entry.name, entry.limits),
                name: entry.name,
            };
            by_digest.insert(digest, Arc::new(key));
        }
        if by_digest.is_empty() {
            return Err(KeysFileError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Self {
            by_digest: Some(by_digest),
        })
    }

    /// Whether keys are on.
    pub fn is_on(&self) -> bool {
        self.by_digest.is_some()
    }

    /// Keys in the file (0 when off).
    pub fn len(&self) -> usize {
        self.by_digest.as_ref().map_or(0, HashMap::len)
    }

    /// Whether there are no keys (keys off).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Who sent a request whose `authorization` header or metadata is `authorization`.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Caller, AuthError> {
        let Some(keys) = &self.by_digest else {
            return Ok(Caller::Anonymous);
        };
        let value = authorization.ok_or(AuthError::Missing)?;
        let token = bearer_token(value).ok_or(AuthError::Malformed)?;
        keys.get(&digest(token))
            .map(|key| Caller::Key(key.clone()))
            .ok_or(AuthError::Unknown)
    }
}

/// The token of `Bearer <token>` (the scheme is case-insensitive, RFC 9110 §11.1).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    let scheme = value.get(..SCHEME.len())?;
    if !scheme.eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = value.get(SCHEME.len()..)?.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// One key line, checked.
struct Entry {
    key: String,
    name: String,
    limits: LimitSpec,
}

/// The fields a line may have after its key.
const FIELDS: [&str; 3] = ["name", "max_concurrent", "tokens_per_minute"];

/// Parses line `line` (1-based); `None` for blank and comment lines. Errors: (field, message).
fn parse_line(raw: &str, line: usize) -> Result<Option<Entry>, (&'static str, String)> {
    let mut words = raw
        .split_ascii_whitespace()
        .take_while(|w| !w.starts_with('#'));
    let Some(key) = words.next() else {
        return Ok(None);
    };
    if let Some(field) = FIELDS.iter().find(|f| key.starts_with(&format!("{f}="))) {
        return Err((
            "key",
            format!("missing: the line starts with `{field}=`, but the key must come first"),
        ));
    }
    check_key(key)?;
    let mut name = None;
    let mut limits = LimitSpec::default();
    for (i, word) in words.enumerate() {
        let position = i + 2;
        let Some((field, value)) = word.split_once('=') else {
            return Err((
                "key",
                format!(
                    "field {position} is not `field=value` (one key per line; fields are {})",
                    FIELDS.join(", ")
                ),
            ));
        };
        match field {
            "name" => set_once(&mut name, "name", check_name(value)?)?,
            "max_concurrent" => set_once(
                &mut limits.max_concurrent,
                "max_concurrent",
                parse_count::<NonZeroUsize>("max_concurrent", value, MAX_CONCURRENT as u64)?,
            )?,
            "tokens_per_minute" => set_once(
                &mut limits.tokens_per_minute,
                "tokens_per_minute",
                parse_count::<NonZeroU32>("tokens_per_minute", value, u64::from(u32::MAX))?,
            )?,
            other => {
                // Echo only what cannot be part of a key pasted in the wrong place.
                let shown = if other.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
                    format!("`{other}`")
                } else {
                    format!("(field {position})")
                };
                return Err((
                    "key",
                    format!("unknown field {shown}; fields are {}", FIELDS.join(", ")),
                ));
            }
        }
    }
    Ok(Some(Entry {
        key: key.to_string(),
        name: name.unwrap_or_else(|| format!("line-{line}")),
        limits,
    }))
}

fn set_once<T>(
    slot: &mut Option<T>,
    field: &'static str,
    value: T,
) -> Result<(), (&'static str, String)> {
    if slot.replace(value).is_some() {
        return Err((field, "is given twice".into()));
    }
    Ok(())
}

/// Checks a key's length and characters; the message never shows the key.
fn check_key(key: &str) -> Result<(), (&'static str, String)> {
    let len = key.len();
    if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&len) {
        return Err((
            "key",
            format!("must be {MIN_KEY_LEN} to {MAX_KEY_LEN} characters, got {len}"),
        ));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err((
            "key",
            "must be visible ASCII characters (`!` to `~`)".into(),
        ));
    }
    Ok(())
}

fn check_name(name: &str) -> Result<String, (&'static str, String)> {
    let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
    if name.is_empty() || name.len() > MAX_NAME_LEN || !name.bytes().all(ok) {
        return Err((
            "name",
            format!(
                "must be 1 to {MAX_NAME_LEN} of `A-Z a-z 0-9 . _ -`, got `{}`",
                name.escape_default()
            ),
        ));
    }
    Ok(name.to_string())
}

/// A count in `1..=max`.
fn parse_count<T: TryFrom<NonZeroU64>>(
    field: &'static str,
    value: &str,
    max: u64,
) -> Result<T, (&'static str, String)> {
    let out_of_range = || {
        (
            field,
            format!(
                "must be an integer in 1..={max}, got `{}`",
                value.escape_default()
            ),
        )
    };
    let n: NonZeroU64 = value.parse().map_err(|_| out_of_range())?;
    if n.get() > max {
        return Err(out_of_range());
    }
    T::try_from(n).map_err(|_| out_of_range())
}

/// Why the keys file could not be used (a start-up error).
#[derive(Debug, thiserror::Error)]
pub enum KeysFileError {
    /// The file could not be read.
    #[error("cannot read the API keys file `{}`: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
    /// A line is invalid.
    #[error("API keys file `{}` line {line}: `{field}` {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// `key`, `name`, `max_concurrent` or `tokens_per_minute`.
        field: &'static str,
        /// The limit and the value (never the key).
        message: String,
    },
    /// The file has no key.
    #[error("API keys file `{}` has no key; give at least one, or leave the file out to turn keys off", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: &str = "alice-0123456789abcdef";
    const BOB: &str = "bob-0123456789abcdef==";

    fn parse(text: &str) -> Result<ApiKeys, KeysFileError> {
        ApiKeys::parse(text, Path::new("keys.txt"))
    }

    fn error(text: &str) -> String {
        parse(text).expect_err(text).to_string()
    }

    fn name_of(keys: &ApiKeys, header: &str) -> Option<String> {
        keys.authenticate(Some(header.as_bytes()))
            .ok()
            .and_then(|c| c.key_name().map(str::to_string))
    }

    #[test]
    fn a_file_with_comments_blanks_and_fields_parses() {
        let text = format!(
            "# keys\n\n   {ALICE} name=alice max_concurrent=2 tokens_per_minute=1000 # trailing\n\t{BOB}\n"
        );
        let keys = parse(&text).expect("valid");
        assert!(keys.is_on());
        assert_eq!(keys.len(), 2);
        assert_eq!(
            name_of(&keys, &format!("Bearer {ALICE}")).as_deref(),
            Some("alice")
        );
        assert_eq!(
            name_of(&keys, &format!("bearer  {BOB} ")).as_deref(),
            Some("line-4")
        );
        let Ok(Caller::Key(alice)) = keys.authenticate(Some(format!("Bearer {ALICE}").as_bytes()))
        else {
            panic!("alice authenticates");
        };
        assert_eq!(alice.limits().max_concurrent(), Some(2));
        assert_eq!(alice.limits().tokens_per_minute(), Some(1000));
    }

    #[test]
    fn wrong_missing_and_malformed_keys_are_refused() {
        let keys = parse(&format!("{ALICE}\n")).expect("valid");
        let auth = |h: Option<&str>| keys.authenticate(h.map(str::as_bytes)).map(|_| ());
        assert_eq!(auth(None), Err(AuthError::Missing));
        assert_eq!(auth(Some(ALICE)), Err(AuthError::Malformed));
        assert_eq!(auth(Some("Basic abc")), Err(AuthError::Malformed));
        assert_eq!(auth(Some("Bearer ")), Err(AuthError::Malformed));
        assert_eq!(
            auth(Some("Bearer alice-0123456789abcdeF")),
            Err(AuthError::Unknown)
        );
        assert_eq!(
            auth(Some(&format!("Bearer {ALICE}x"))),
            Err(AuthError::Unknown)
        );
        assert_eq!(auth(Some(&format!("Bearer {ALICE}"))), Ok(()));
    }

    #[test]
    fn keys_off_lets_anyone_in() {
        let keys = ApiKeys::load(None).expect("off");
        assert!(!keys.is_on());
        assert!(matches!(keys.authenticate(None), Ok(Caller::Anonymous)));
    }

    #[test]
    fn errors_name_the_line_and_field_and_never_the_key() {
        let cases: Vec<(String, &str)> = vec![
            (
                "short-key\n".into(),
                "line 1: `key` must be 16 to 256 characters, got 9",
            ),
            (
                format!("# c\n{ALICE} max_concurrent=0\n"),
                "line 2: `max_concurrent` must be an integer in 1..=",
            ),
            (
                format!("{ALICE} tokens_per_minute=4294967296\n"),
                "`tokens_per_minute` must be an integer in 1..=4294967295, got `4294967296`",
            ),
            (format!("{ALICE} tokens_per_minute=lots\n"), "got `lots`"),
            (
                format!("{ALICE} name=a name=b\n"),
                "line 1: `name` is given twice",
            ),
            (
                format!("{ALICE} name=has/slash\n"),
                "`name` must be 1 to 64",
            ),
            (format!("{ALICE} colour=red\n"), "unknown field `colour`"),
            (format!("{ALICE} {BOB}\n"), "unknown field (field 2)"),
            (format!("{ALICE} {ALICE}\n"), "field 2 is not `field=value`"),
            (
                "name=alice max_concurrent=1\n".into(),
                "`key` missing: the line starts with `name=`",
            ),
            (
                format!("{ALICE}\n{ALICE} name=x\n"),
                "line 2: `key` must be unique, but line 1",
            ),
            (
                format!("{ALICE} name=a\n{BOB} name=a\n"),
                "line 2: `name` must be unique",
            ),
            ("# only comments\n\n".into(), "has no key"),
        ];
        for (text, want) in cases {
            let e = error(&text);
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.contains("keys.txt"), "{e}");
            assert!(!e.contains(ALICE) && !e.contains(BOB), "leaks a key: {e}");
        }
    }

    #[test]
    fn an_unreadable_file_names_its_path() {
        let e = ApiKeys::load(Some(Path::new("/nonexistent/keys.txt"))).expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/keys.txt"), "{e}");
    }
}
