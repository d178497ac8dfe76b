//! The protobuf codec of the generated client and server: prost's, except that a message is
//! encoded into a buffer reserved for its whole length first.
//!
//! tonic's buffer starts at 8 KiB and grows by doubling, so a 50 MiB plan was copied about
//! six times as it was encoded (each copy into freshly faulted memory) before its first
//! byte went out. Its length is known before encoding (`Message::encoded_len`, a walk over
//! the lengths only), so it is reserved once.

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, EncodeBuf, Encoder};
use tonic_prost::{ProstCodec, ProstDecoder};

/// The codec named in `build.rs` (`codec_path`).
#[derive(Debug, Clone)]
pub struct Codec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = Reserving<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        Reserving(std::marker::PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        self.0.decoder()
    }
}

/// Encodes a message after reserving its encoded length.
#[derive(Debug, Clone, Default)]
pub struct Reserving<T>(std::marker::PhantomData<T>);

impl<T: Message> Encoder for Reserving<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
