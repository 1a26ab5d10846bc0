//! Failures and refusals to and from their wire form, shared by the transports that carry the
//! `transfer.proto` control messages (TCP, UCX).

use ferry_proto::internal::{TransferFailure, TransferHelloAck};

use crate::{check_compatible, KvLayoutDesc, RemoteKey, TransferError};

pub(crate) fn from_failure(f: TransferFailure, key: RemoteKey) -> TransferError {
    match f.kind.as_str() {
        "out_of_range" => TransferError::OutOfRange {
            layer: f.layer,
            block: f.block,
            len: usize::try_from(f.len).unwrap_or(usize::MAX),
        },
        "unknown_region" => TransferError::UnknownRegion(key),
        "region" => TransferError::Region(f.message),
        "closed" => TransferError::Closed,
        kind => TransferError::Protocol(format!("receiver failed ({kind}): {}", f.message)),
    }
}

pub(crate) fn to_failure(e: &TransferError) -> TransferFailure {
    let mut f = TransferFailure {
        kind: e.kind().to_owned(),
        ..TransferFailure::default()
    };
    match e {
        TransferError::OutOfRange { layer, block, len } => {
            f.layer = *layer;
            f.block = *block;
            f.len = *len as u64;
            f.message = e.to_string();
        }
        TransferError::Region(m) | TransferError::Protocol(m) => f.message = m.clone(),
        other => f.message = other.to_string(),
    }
    f
}

/// Rebuilds the receiver's refusal as the error the writer would have computed itself.
/// The writer's verdict on a hello ack: the receiver's layout when it accepted and the layouts
/// are compatible, else the error the writer would have computed itself.
pub(crate) fn accepted_layout(
    ack: &TransferHelloAck,
    key: RemoteKey,
    writer_layout: &KvLayoutDesc,
) -> Result<KvLayoutDesc, TransferError> {
    let remote = ack
        .layout
        .as_ref()
        .map(KvLayoutDesc::try_from)
        .transpose()?;
    if !ack.error.is_empty() {
        return Err(refusal(ack, key, writer_layout, remote));
    }
    let remote = remote
        .ok_or_else(|| TransferError::Protocol("TransferHelloAck: `layout` is missing".into()))?;
    check_compatible(writer_layout, &remote)?;
    Ok(remote)
}

fn refusal(
    ack: &TransferHelloAck,
    key: RemoteKey,
    writer_layout: &KvLayoutDesc,
    remote: Option<KvLayoutDesc>,
) -> TransferError {
    match (ack.kind.as_str(), remote) {
        ("unknown_region", _) => TransferError::UnknownRegion(key),
        ("unauthenticated", _) => TransferError::Unauthenticated,
        ("layout_mismatch", Some(remote)) => check_compatible(writer_layout, &remote)
            .err()
            .unwrap_or_else(|| TransferError::Protocol(ack.error.clone())),
        (kind, _) => TransferError::Protocol(format!(
            "receiver refused the connection ({kind}): {}",
            ack.error
        )),
    }
}
