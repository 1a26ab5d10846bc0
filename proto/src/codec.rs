//! The codec of every ferry service and client: prost's, with decode failures coded by who
//! sent the bytes.
//!
//! tonic's prost codec answers any message it cannot decode with INTERNAL, which says the
//! server is at fault; a request that is not valid protobuf (or not the message the method
//! takes) is the client's mistake, so [`FerryCodec`] answers it with INVALID_ARGUMENT naming
//! the message type. A *response* that cannot be decoded stays INTERNAL on the client side (a
//! broken or mismatched peer, as gRPC's status-code guide has it). Which messages are requests
//! is known from the services themselves: `build.rs` implements [`WireMessage`] for every
//! rpc's input and output type.
use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

/// A message one of ferry's rpcs sends or receives (implemented by `build.rs`).
pub trait WireMessage {
    /// Full protobuf name, e.g. `ferry.v1.GenerateRequest`.
    const NAME: &'static str;
    /// An rpc's input (servers decode it) rather than only an output (clients decode it).
    const IS_REQUEST: bool;
}

/// The `codec_path` of the generated stubs: prost encoding, [`FerryDecoder`] decoding.
#[derive(Debug, Clone)]
pub struct FerryCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for FerryCodec<T, U> {
    fn default() -> Self {
        Self {
            _types: PhantomData,
        }
    }
}

impl<T, U> Codec for FerryCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + WireMessage + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = FerryDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        FerryDecoder {
            inner: ProstDecoder::new(BufferSettings::default()),
        }
    }
}

/// prost's decoder, with its failure recoded: INVALID_ARGUMENT for a request, INTERNAL for a
/// response, the message naming the type and prost's reason.
#[derive(Debug, Clone)]
pub struct FerryDecoder<U> {
    inner: ProstDecoder<U>,
}

impl<U: Message + Default + WireMessage> Decoder for FerryDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|status| {
            let message = format!("cannot decode `{}`: {}", U::NAME, status.message());
            if U::IS_REQUEST {
                Status::invalid_argument(message)
            } else {
                Status::internal(message)
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

include!(concat!(env!("OUT_DIR"), "/wire_messages.rs"));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{internal, v1};

    #[test]
    fn requests_and_responses_are_told_apart() {
        assert!(<v1::GenerateRequest as WireMessage>::IS_REQUEST);
        assert!(<v1::TokenizeRequest as WireMessage>::IS_REQUEST);
        assert!(<internal::KvEventBatch as WireMessage>::IS_REQUEST);
        assert!(!<v1::GenerateResponse as WireMessage>::IS_REQUEST);
        assert!(!<internal::WorkerStats as WireMessage>::IS_REQUEST);
        assert_eq!(
            <v1::GenerateRequest as WireMessage>::NAME,
            "ferry.v1.GenerateRequest"
        );
    }
}
