//! The protobuf codec of the generated services (rate limit, quota, aggregated discovery): prost's encoding, with one difference on
//! decoding. A request that does not decode (a truncated field, a domain that is not UTF-8) is
//! the caller's error, so the server answers `INVALID_ARGUMENT` with prost's message, where
//! tonic's stock codec answers `INTERNAL`. A response that does not decode (client side) stays
//! `INTERNAL`.

use std::marker::PhantomData;

use bytes::Buf;
use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};

use super::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports, RateLimitRequest, RateLimitResponse,
};

/// A message this codec decodes, with the status its decoding errors become.
pub trait Wire: Message + Default + Send + 'static {
    /// The status for a message of this type that does not decode.
    fn decode_error(error: prost::DecodeError) -> Status {
        Status::internal(format!("cannot decode the response: {error}"))
    }
}

impl Wire for RateLimitRequest {
    fn decode_error(error: prost::DecodeError) -> Status {
        Status::invalid_argument(format!("cannot decode the request: {error}"))
    }
}

impl Wire for RateLimitResponse {}

impl Wire for RateLimitQuotaUsageReports {
    fn decode_error(error: prost::DecodeError) -> Status {
        Status::invalid_argument(format!("cannot decode the usage reports: {error}"))
    }
}

impl Wire for RateLimitQuotaResponse {}

impl Wire for super::envoy::service::discovery::v3::DiscoveryResponse {}

impl Wire for super::envoy::service::discovery::v3::DiscoveryRequest {
    fn decode_error(error: prost::DecodeError) -> Status {
        Status::invalid_argument(format!("cannot decode the discovery request: {error}"))
    }
}

/// The codec the generated service and client use (`build.rs` names it).
#[derive(Debug, Clone, Copy)]
pub struct RlsCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for RlsCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for RlsCodec<T, U>
where
    T: Message + Send + 'static,
    U: Wire,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = WireDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        WireDecoder(PhantomData)
    }
}

/// Decodes one message, mapping a failure as its type says.
#[derive(Debug, Clone, Copy)]
pub struct WireDecoder<U>(PhantomData<U>);

impl<U: Wire> Decoder for WireDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        from_slice(buf, |bytes| U::decode(bytes))
            .map(Some)
            .map_err(U::decode_error)
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// `decode` of the whole message in `buf`, which it then consumes. tonic holds a message whole
/// in one buffer: read from its slice, prost's varints and lengths take the slice's inlined
/// path instead of a call through `Buf` for each. A message in pieces is copied together first.
///
/// # Errors
///
/// `decode`'s.
pub fn from_slice<T>(
    buf: &mut DecodeBuf<'_>,
    decode: impl FnOnce(&[u8]) -> Result<T, prost::DecodeError>,
) -> Result<T, prost::DecodeError> {
    let len = buf.remaining();
    let decoded = if buf.chunk().len() == len {
        decode(buf.chunk())
    } else {
        decode(&buf.copy_to_bytes(len))
    };
    buf.advance(buf.remaining());
    decoded
}
