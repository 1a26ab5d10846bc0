//! The internal plane's shared secret: a [`ClusterToken`] every router and worker of one
//! cluster holds, sent as `authorization: Bearer <token>` on every internal gRPC call and in
//! the KV transfer hello, and checked by the receiver in constant time.
//!
//! ```text
//! client  AttachToken (tonic interceptor)  ──authorization: Bearer t──►  RequireToken  server
//!         Registry, DecodeWorker, PrefillWorker calls                    UNAUTHENTICATED if ≠
//! ```
//!
//! A cluster without a token (`None`) authenticates nothing: the router allows that only on a
//! loopback internal address, and `ferry up` always generates one. The token never appears in
//! `Debug` output or logs.
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Shortest token accepted: 16 characters (a random hex token of 64 bits or more).
pub const MIN_TOKEN_LEN: usize = 16;

/// The metadata key the token travels in.
const HEADER: &str = "authorization";

/// Why a token could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    /// Shorter than [`MIN_TOKEN_LEN`].
    #[error("the cluster token must have at least {MIN_TOKEN_LEN} characters, got {0}")]
    TooShort(usize),
    /// Whitespace or a control character inside it (it travels in a header).
    #[error("the cluster token must be printable ASCII without spaces")]
    NotPrintable,
    /// Both a token file and a token were given.
    #[error("give the cluster token as a file or in FERRY_CLUSTER_TOKEN, not both")]
    Ambiguous,
    /// The token file could not be read.
    #[error("reading the cluster token file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// The I/O error.
        reason: String,
    },
}

/// The cluster's shared secret (cheap to clone; redacted in `Debug`).
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken(Arc<str>);

impl ClusterToken {
    /// Reads a token from a file: the first line, surrounding whitespace trimmed.
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        text.lines().next().unwrap_or("").parse()
    }

    /// The token a process was given: from `file` or `direct` (the `FERRY_CLUSTER_TOKEN`
    /// variable), not both; `None` when neither is set.
    pub fn resolve(
        file: Option<&Path>,
        direct: Option<&ClusterToken>,
    ) -> Result<Option<Self>, TokenError> {
        match (file, direct) {
            (Some(_), Some(_)) => Err(TokenError::Ambiguous),
            (Some(path), None) => Self::from_file(path).map(Some),
            (None, direct) => Ok(direct.cloned()),
        }
    }

    /// A fresh random token (32 bytes of OS randomness, hex): what `ferry up` gives its children.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand_bytes();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(hex.into())
    }

    /// The secret itself, to hand to a child process or a transport hello.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let ours = self.0.as_bytes();
        if ours.len() != presented.len() {
            return false;
        }
        ours.iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

fn rand_bytes() -> [u8; 32] {
    use rand::RngCore as _;
    let mut out = [0u8; 32];
    rand::rng().fill_bytes(&mut out);
    out
}

impl FromStr for ClusterToken {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.len() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort(s.len()));
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotPrintable);
        }
        Ok(Self(s.into()))
    }
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
    }
}

/// Client side: adds `authorization: Bearer <token>` to every call (nothing without a token).
#[derive(Debug, Clone, Default)]
pub struct AttachToken(Option<ClusterToken>);

impl AttachToken {
    /// Attaches `token`, if any.
    pub fn new(token: Option<ClusterToken>) -> Self {
        Self(token)
    }
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            let value = MetadataValue::try_from(format!("Bearer {}", token.expose()))
                .map_err(|_| Status::internal("the cluster token is not a valid header value"))?;
            request.metadata_mut().insert(HEADER, value);
        }
        Ok(request)
    }
}

/// Server side: refuses a call without the cluster's token with UNAUTHENTICATED (lets every
/// call through when the cluster has no token).
#[derive(Debug, Clone, Default)]
pub struct RequireToken(Option<ClusterToken>);

impl RequireToken {
    /// Requires `token`, if any.
    pub fn new(token: Option<ClusterToken>) -> Self {
        Self(token)
    }
}

impl Interceptor for RequireToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.0 else {
            return Ok(request);
        };
        let presented = request
            .metadata()
            .get(HEADER)
            .map(|v| v.as_bytes())
            .and_then(|v| v.strip_prefix(b"Bearer "));
        match presented {
            Some(p) if token.matches(p) => Ok(request),
            Some(_) => Err(Status::unauthenticated(
                "internal plane: wrong cluster token",
            )),
            None => Err(Status::unauthenticated(
                "internal plane: missing `authorization: Bearer <cluster token>`",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> ClusterToken {
        "0123456789abcdef-secret".parse().expect("valid")
    }

    #[test]
    fn tokens_are_checked_redacted_and_random() {
        assert_eq!(
            "short".parse::<ClusterToken>(),
            Err(TokenError::TooShort(5))
        );
        assert_eq!(
            "0123456789 abcdef".parse::<ClusterToken>(),
            Err(TokenError::NotPrintable)
        );
        assert!(!format!("{:?}", token()).contains("secret"));
        let (a, b) = (ClusterToken::generate(), ClusterToken::generate());
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 64);
        assert!(a.matches(a.expose().as_bytes()));
        assert!(!a.matches(b.expose().as_bytes()));
        assert!(!a.matches(&a.expose().as_bytes()[1..]));
    }

    #[test]
    fn the_server_refuses_what_the_client_did_not_sign() {
        let mut server = RequireToken::new(Some(token()));
        let missing = server.call(Request::new(())).expect_err("no header");
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(missing.message().contains("missing"), "{missing:?}");

        let wrong = AttachToken::new(Some("fedcba9876543210-other".parse().expect("valid")))
            .call(Request::new(()))
            .expect("attach");
        let err = server.call(wrong).expect_err("wrong token");
        assert_eq!(err.code(), tonic::Code::Unauthenticated);

        let signed = AttachToken::new(Some(token()))
            .call(Request::new(()))
            .expect("attach");
        server.call(signed).expect("the right token passes");
        // A cluster without a token lets everything through.
        RequireToken::new(None)
            .call(Request::new(()))
            .expect("open plane");
    }
}
