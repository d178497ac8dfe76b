//! `SubmitPlanDocument`: a plan file sent as it is written, in pieces, and parsed by the
//! agent as they arrive.
//!
//! `ApplyPlan` carries a plan as one message: the client parses the whole file and encodes
//! it before the first byte leaves, and the agent decodes the whole message before it
//! starts. For a plan with 50 MiB of file content those are three passes one after the
//! other. Here the client sends the file's bytes as it reads them, and the agent feeds
//! them, on a thread of the call's own, to the plan-file reader `inplace-agent apply` uses (which
//! decodes long strings as they are read) while more arrive.
//!
//! The document's length is declared in the call's metadata ([`DOCUMENT_BYTES`]) before
//! any piece: the request budget (`budget.rs`) holds that many bytes for the call (what
//! the parsed plan holds) and the agent refuses a document that turns out longer or
//! shorter. The plan is accepted only after its last byte was read and its length checked,
//! so a stream that breaks, or a length that was not true, leaves nothing behind.

use std::io::{self, Read};

use bytes::{Buf, Bytes};
use tokio::sync::mpsc;
use tonic::Status;

use super::pb;

/// The metadata key carrying the document's length in bytes (decimal).
pub const DOCUMENT_BYTES: &str = "inplace-document-bytes";

/// The HTTP/2 path of `SubmitPlanDocument`.
pub const PATH: &str = "/inplace.agent.v1.NodeAgent/SubmitPlanDocument";

/// Bytes a client puts into one piece.
pub const PIECE_BYTES: usize = 1 << 20;

/// Pieces received and not parsed yet, at most: beyond that the receiving side waits for
/// the parser (and HTTP/2 flow control makes the client wait in turn).
pub const PIECES_IN_FLIGHT: usize = 4;

/// Longest document name used in messages, in bytes.
const MAX_NAME: usize = 256;

/// The length the headers of a `SubmitPlanDocument` call declare, when they declare one.
pub fn declared_in(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(DOCUMENT_BYTES)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The declared length of the call's document, or why the call is refused before a piece
/// is read: no length, or more than `max`.
pub fn declared_bytes(
    metadata: &tonic::metadata::MetadataMap,
    max: usize,
) -> Result<usize, Status> {
    if metadata.get(DOCUMENT_BYTES).is_none() {
        return Err(Status::invalid_argument(format!(
            "metadata {DOCUMENT_BYTES}: is required (the plan document's length in bytes)"
        )));
    }
    let declared = declared_in(metadata.as_ref()).ok_or_else(|| {
        Status::invalid_argument(format!(
            "metadata {DOCUMENT_BYTES}: is not a number of bytes"
        ))
    })?;
    match usize::try_from(declared) {
        Ok(bytes) if bytes <= max => Ok(bytes),
        _ => Err(Status::resource_exhausted(format!(
            "the plan document of {declared} bytes is more than the limit of {max} bytes of \
             this agent (grpc.max_message_bytes)"
        ))),
    }
}

/// The name the document goes by in messages: the client's, cut to [`MAX_NAME`] bytes;
/// "plan" when it gave none.
pub fn name(given: &str) -> String {
    if given.is_empty() {
        return "plan".to_owned();
    }
    let mut end = given.len().min(MAX_NAME);
    while !given.is_char_boundary(end) {
        end -= 1;
    }
    given[..end].chars().filter(|c| !c.is_control()).collect()
}

/// What the receiving side hands the parser.
pub enum Next {
    /// The next bytes of the document.
    Data(Bytes),
    /// The document ended with the length it declared.
    End,
    /// It did not arrive whole: why.
    Failed(io::Error),
}

/// The pieces received so far as one `Read`. It ends only when the receiving side says the
/// document ended whole ([`Next::End`]): a receiving side that went away without saying so
/// (its call dropped at a deadline or a shutdown) is a read error, never the end of the
/// document, or a plan cut short at a line boundary would be accepted.
pub struct Pieces {
    rx: mpsc::Receiver<Next>,
    current: Bytes,
    ended: bool,
}

impl Pieces {
    /// The reader of the pieces that arrive on `rx`, in order.
    pub fn new(rx: mpsc::Receiver<Next>) -> Pieces {
        Pieces {
            rx,
            current: Bytes::new(),
            ended: false,
        }
    }
}

impl Read for Pieces {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.ended {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Next::Data(piece)) => self.current = piece,
                Some(Next::End) => self.ended = true,
                Some(Next::Failed(e)) => return Err(e),
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "the call ended before its plan document did",
                    ));
                }
            }
        }
        let n = out.len().min(self.current.len());
        out[..n].copy_from_slice(&self.current[..n]);
        self.current.advance(n);
        Ok(n)
    }
}

/// Hands the call's pieces, `first` first, to the parser behind `tx`, checking them
/// against the `declared` length, and then the end; stops early when the parser has
/// stopped reading (it has its answer). A broken stream or a wrong length reaches the
/// parser as a read error, in place of the end.
pub async fn forward(
    first: Bytes,
    pieces: &mut tonic::Streaming<pb::PlanDocumentPiece>,
    declared: usize,
    tx: mpsc::Sender<Next>,
) {
    let mut total = 0usize;
    let mut next = Some(first);
    loop {
        let data = match next.take() {
            Some(data) => data,
            None => match pieces.message().await {
                Ok(Some(piece)) => piece.data,
                Ok(None) if total == declared => {
                    let _ = tx.send(Next::End).await;
                    return;
                }
                Ok(None) => {
                    let _ = tx
                        .send(Next::Failed(wrong_length(format!(
                            "the plan document ended after {total} bytes, but its metadata \
                             {DOCUMENT_BYTES} declared {declared}"
                        ))))
                        .await;
                    return;
                }
                Err(status) => {
                    let _ = tx
                        .send(Next::Failed(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            format!(
                                "the call broke after {total} bytes of the plan document: {}",
                                status.message()
                            ),
                        )))
                        .await;
                    return;
                }
            },
        };
        total = total.saturating_add(data.len());
        if total > declared {
            let _ = tx
                .send(Next::Failed(wrong_length(format!(
                    "the plan document is longer than the {declared} bytes its metadata \
                     {DOCUMENT_BYTES} declared"
                ))))
                .await;
            return;
        }
        if !data.is_empty() && tx.send(Next::Data(data)).await.is_err() {
            return;
        }
    }
}

fn wrong_length(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// The status of a document that did not arrive whole: a wrong length is the caller's
/// error; a broken call is reported as cancelled (the caller is usually gone).
pub fn read_status(e: &io::Error) -> Status {
    let message = format!("{e}; nothing was accepted");
    match e.kind() {
        io::ErrorKind::InvalidData => Status::invalid_argument(message),
        _ => Status::cancelled(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(value: Option<&str>) -> tonic::metadata::MetadataMap {
        let mut m = tonic::metadata::MetadataMap::new();
        if let Some(v) = value {
            m.insert(DOCUMENT_BYTES, v.parse().unwrap());
        }
        m
    }

    #[test]
    fn the_declared_length_is_required_a_number_and_within_the_limit() {
        assert_eq!(declared_bytes(&metadata(Some("1000")), 1000).unwrap(), 1000);
        let missing = declared_bytes(&metadata(None), 1000).unwrap_err();
        assert_eq!(missing.code(), tonic::Code::InvalidArgument);
        assert!(missing.message().contains("is required"), "{missing}");
        let garbage = declared_bytes(&metadata(Some("ten")), 1000).unwrap_err();
        assert_eq!(garbage.code(), tonic::Code::InvalidArgument);
        let over = declared_bytes(&metadata(Some("1001")), 1000).unwrap_err();
        assert_eq!(over.code(), tonic::Code::ResourceExhausted);
        assert!(
            over.message().contains("more than the limit of 1000 bytes"),
            "{over}"
        );
    }

    #[test]
    fn names_are_cut_at_a_character_and_lose_control_characters() {
        assert_eq!(name(""), "plan");
        assert_eq!(name("a\nb.yaml"), "ab.yaml");
        let long = "é".repeat(200);
        let cut = name(&long);
        assert!(
            cut.len() <= MAX_NAME && cut.len() >= MAX_NAME - 1,
            "{}",
            cut.len()
        );
    }

    #[test]
    fn pieces_read_in_order_and_end_or_fail_as_the_receiving_side_says() {
        let read = |sent: Vec<Next>| {
            let (tx, rx) = mpsc::channel(8);
            for next in sent {
                assert!(tx.try_send(next).is_ok());
            }
            drop(tx);
            let mut all = Vec::new();
            let result = Pieces::new(rx).read_to_end(&mut all);
            (result, String::from_utf8(all).unwrap())
        };
        let data = |s: &'static str| Next::Data(Bytes::from_static(s.as_bytes()));

        let (result, all) = read(vec![data("hello "), data("world"), Next::End]);
        assert_eq!(result.unwrap(), 11);
        assert_eq!(all, "hello world");

        let (result, all) = read(vec![
            data("hel"),
            Next::Failed(wrong_length("short".into())),
        ]);
        let e = result.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(read_status(&e).code(), tonic::Code::InvalidArgument);
        assert_eq!(all, "hel");

        // The receiving side dropped without saying the document ended (its call was
        // dropped): an error, not the end, though what came is a whole plan by itself.
        let (result, all) = read(vec![data("apiVersion: inplace.agent/v1\n")]);
        let e = result.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        assert_eq!(read_status(&e).code(), tonic::Code::Cancelled);
        assert_eq!(all, "apiVersion: inplace.agent/v1\n");
    }
}
