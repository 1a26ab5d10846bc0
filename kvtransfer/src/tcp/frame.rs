//! Framing shared by both sides: `u32 length | u8 tag | body` (see the module docs of `tcp`),
//! and failures to and from their wire form.

use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::TransferError;

/// Largest single socket write of payload bytes (4 MiB).
pub const MAX_WRITE: usize = 4 << 20;

pub(super) const TAG_HELLO: u8 = 1;
pub(super) const TAG_HELLO_ACK: u8 = 2;
pub(super) const TAG_DATA: u8 = 3;
pub(super) const TAG_FLUSH: u8 = 4;
pub(super) const TAG_FLUSH_ACK: u8 = 5;
pub(super) const TAG_FAILURE: u8 = 6;

/// Largest protobuf control frame body either side accepts.
const MAX_CONTROL_FRAME: u32 = 64 << 10;
/// Data frame body before the payload: `u32 layer`, `u32 block`.
pub(super) const DATA_HEADER: u32 = 8;

pub(super) async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<(u8, u32)>, TransferError> {
    let mut hdr = [0u8; 5];
    let n = r.read(&mut hdr).await?;
    if n == 0 {
        return Ok(None);
    }
    if let Some(rest) = hdr.get_mut(n..) {
        r.read_exact(rest).await?;
    }
    let [a, b, c, d, tag] = hdr;
    let len = u32::from_be_bytes([a, b, c, d]);
    let Some(body) = len.checked_sub(1) else {
        return Err(TransferError::Protocol(
            "frame length 0 (it must count the tag byte)".into(),
        ));
    };
    Ok(Some((tag, body)))
}

pub(super) async fn read_control<M: Message + Default, R: AsyncRead + Unpin>(
    r: &mut R,
    len: u32,
    what: &str,
) -> Result<M, TransferError> {
    if len > MAX_CONTROL_FRAME {
        return Err(TransferError::Protocol(format!(
            "{what} frame of {len} bytes exceeds the {MAX_CONTROL_FRAME}-byte limit"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    M::decode(body.as_slice())
        .map_err(|e| TransferError::Protocol(format!("malformed {what}: {e}")))
}

pub(super) async fn write_control<W: AsyncWrite + Unpin, M: Message>(
    w: &mut W,
    tag: u8,
    msg: &M,
) -> Result<(), TransferError> {
    let body = msg.encode_to_vec();
    let len = u32::try_from(body.len() + 1)
        .map_err(|_| TransferError::Protocol("control frame too large".into()))?;
    let mut frame = Vec::with_capacity(body.len() + 5);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.push(tag);
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

pub(super) fn unexpected(tag: u8, len: u32, expected: &str) -> TransferError {
    TransferError::Protocol(format!(
        "expected {expected} frame, got tag {tag} with a {len}-byte body"
    ))
}

pub(super) fn data_header(layer: u32, block: u32, len: usize) -> Result<[u8; 13], TransferError> {
    let frame_len = u32::try_from(len)
        .ok()
        .and_then(|n| n.checked_add(1 + DATA_HEADER))
        .ok_or_else(|| {
            TransferError::Protocol(format!(
                "a block of {len} bytes does not fit one data frame (max {} bytes)",
                u32::MAX - 1 - DATA_HEADER
            ))
        })?;
    let mut h = [0u8; 13];
    h[..4].copy_from_slice(&frame_len.to_be_bytes());
    h[4] = TAG_DATA;
    h[5..9].copy_from_slice(&layer.to_be_bytes());
    h[9..13].copy_from_slice(&block.to_be_bytes());
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{from_failure, to_failure};
    use crate::RemoteKey;

    #[test]
    fn failures_round_trip_their_kind() {
        let key = RemoteKey(9);
        let cases = [
            TransferError::OutOfRange {
                layer: 1,
                block: 2,
                len: 3,
            },
            TransferError::Region("pool gone".into()),
            TransferError::UnknownRegion(key),
            TransferError::Closed,
        ];
        for e in cases {
            let back = from_failure(to_failure(&e), key);
            assert_eq!(back.kind(), e.kind());
            assert_eq!(back.to_string(), e.to_string());
        }
    }

    #[tokio::test]
    async fn headers_round_trip_and_eof_is_clean() {
        let h = data_header(5, 6, 7).unwrap();
        let mut r = &h[..];
        assert_eq!(
            read_header(&mut r).await.unwrap(),
            Some((TAG_DATA, DATA_HEADER + 7))
        );
        let mut empty: &[u8] = &[];
        assert_eq!(read_header(&mut empty).await.unwrap(), None);
        let mut zero: &[u8] = &[0, 0, 0, 0, 1];
        assert!(matches!(
            read_header(&mut zero).await,
            Err(TransferError::Protocol(_))
        ));
    }
}
