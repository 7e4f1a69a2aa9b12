//! The gRPC codec of iadeep's services: prost's, except for what a request that does
//! not decode is answered with.
//!
//! tonic's prost codec answers a message that does not decode with INTERNAL, as gRPC's
//! status guide says for a parse error in general. For a *request* that tells a client
//! that the server failed and that asking again may help, when its own bytes are wrong
//! and asking again never will: the stubs are generated with this codec, which answers
//! INVALID_ARGUMENT for an undecodable request (the same code every other malformed
//! request gets). An undecodable *response* is still INTERNAL, as the client cannot
//! have caused it. Requests and responses are told apart by their message's name,
//! which the services' own convention fixes: `FooRequest` in, `FooResponse` out.

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// [`ProstCodec`] with [`RequestDecoder`] (see the module documentation).
#[derive(Debug, Clone)]
pub struct IadeepCodec<T, U> {
    inner: ProstCodec<T, U>,
}

impl<T, U> Default for IadeepCodec<T, U> {
    fn default() -> Self {
        IadeepCodec {
            inner: ProstCodec::default(),
        }
    }
}

impl<T, U> Codec for IadeepCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = RequestDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.inner.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder {
            inner: self.inner.decoder(),
        }
    }
}

/// prost's decoder; a request that does not decode is INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct RequestDecoder<U> {
    inner: ProstDecoder<U>,
}

/// Whether `U` is a request message of a service (see the module documentation).
fn is_request<U>() -> bool {
    std::any::type_name::<U>().ends_with("Request")
}

impl<U: prost::Message + Default> Decoder for RequestDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|status| {
            if is_request::<U>() && status.code() == tonic::Code::Internal {
                let name = std::any::type_name::<U>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("request");
                Status::invalid_argument(format!(
                    "the {name} does not decode as protobuf: {}",
                    status.message()
                ))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_responses_are_told_apart_by_name() {
        assert!(is_request::<crate::PlaceRequest>());
        assert!(is_request::<crate::ReleaseRequest>());
        assert!(is_request::<crate::ListDevicesRequest>());
        assert!(!is_request::<crate::PlaceResponse>());
        assert!(!is_request::<crate::TaskSpec>());
    }
}
