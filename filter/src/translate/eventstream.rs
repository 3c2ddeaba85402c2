//! AWS event-stream framing (`application/vnd.amazon.eventstream`, Bedrock ConverseStream),
//! decoded frame by frame as the body passes.
//!
//! A message: the prelude (total length u32 BE, headers length u32 BE, CRC32 of those 8 bytes),
//! the headers (name length u8, name, value type u8, value; type 7, a string, with a u16 BE
//! length), the payload, and the CRC32 of everything before it. Both CRCs are checked before a
//! message is read. Only the incomplete trailing message is carried from one chunk to the next,
//! bounded by [`FRAME_CAP`].

/// Largest message accepted (real ones are a few hundred bytes); a longer one ends the stream.
pub const FRAME_CAP: usize = 1024 * 1024;
const PRELUDE: usize = 12;
/// Prelude plus the message CRC.
const OVERHEAD: usize = 16;

/// One decoded message: the headers the translation reads, and the payload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    /// `:message-type`: `event` or `exception` (`error` for a malformed request).
    pub message_type: String,
    /// `:event-type` of an event (`messageStart`, `contentBlockDelta`…), `:exception-type` of
    /// an exception, `:error-code` of an error.
    pub kind: String,
    pub payload: Vec<u8>,
}

/// Why the stream cannot be read further.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    TooLarge(usize),
    Malformed(&'static str),
    PreludeCrc,
    MessageCrc,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLarge(n) => write!(f, "an event-stream message of {n} bytes"),
            FrameError::Malformed(why) => write!(f, "a malformed event-stream message: {why}"),
            FrameError::PreludeCrc => f.write_str("an event-stream prelude CRC mismatch"),
            FrameError::MessageCrc => f.write_str("an event-stream message CRC mismatch"),
        }
    }
}

/// Decodes one event stream, chunk by chunk.
#[derive(Debug, Default)]
pub struct Decoder {
    /// The incomplete trailing message.
    carried: Vec<u8>,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s: [u8; 4] = b.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_be_bytes(s))
}

fn crc(bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(bytes);
    h.finalize()
}

impl Decoder {
    /// Bytes carried to the next chunk.
    pub fn carried(&self) -> usize {
        self.carried.len()
    }

    /// The complete messages of `chunk` (with what was carried), in order; an error ends the
    /// stream (the messages before it are returned with it).
    pub fn feed(&mut self, chunk: &[u8]) -> (Vec<Message>, Option<FrameError>) {
        let mut out = Vec::new();
        // Fast path: nothing carried, the chunk read in place.
        let owned;
        let data: &[u8] = if self.carried.is_empty() {
            chunk
        } else {
            self.carried.extend_from_slice(chunk);
            owned = std::mem::take(&mut self.carried);
            &owned
        };
        let mut at = 0usize;
        loop {
            let rest = data.get(at..).unwrap_or_default();
            if rest.len() < PRELUDE {
                break;
            }
            let total = u32_at(rest, 0).map_or(0, |n| n as usize);
            if total > FRAME_CAP {
                return (out, Some(FrameError::TooLarge(total)));
            }
            if u32_at(rest, 8) != Some(crc(rest.get(..8).unwrap_or_default())) {
                return (out, Some(FrameError::PreludeCrc));
            }
            let Some(frame) = rest.get(..total) else {
                break;
            };
            match decode(frame) {
                Ok(m) => out.push(m),
                Err(e) => return (out, Some(e)),
            }
            at = at.saturating_add(total);
        }
        let rest = data.get(at..).unwrap_or_default();
        if rest.len() > FRAME_CAP {
            return (out, Some(FrameError::TooLarge(rest.len())));
        }
        self.carried = rest.to_vec();
        (out, None)
    }
}

/// One whole message (its prelude CRC already checked).
fn decode(frame: &[u8]) -> Result<Message, FrameError> {
    let total = frame.len();
    let headers_len = u32_at(frame, 4).map_or(0, |n| n as usize);
    if total < OVERHEAD || headers_len > total - OVERHEAD {
        return Err(FrameError::Malformed("lengths"));
    }
    let body_end = total - 4;
    if u32_at(frame, body_end) != Some(crc(frame.get(..body_end).unwrap_or_default())) {
        return Err(FrameError::MessageCrc);
    }
    let headers = frame
        .get(PRELUDE..PRELUDE + headers_len)
        .ok_or(FrameError::Malformed("headers"))?;
    let mut m = Message {
        payload: frame
            .get(PRELUDE + headers_len..body_end)
            .unwrap_or_default()
            .to_vec(),
        ..Message::default()
    };
    let mut event_type = String::new();
    let mut other_kind = String::new();
    read_headers(headers, |name, value| match name {
        b":message-type" => m.message_type = value.to_string(),
        b":event-type" => event_type = value.to_string(),
        b":exception-type" | b":error-code" => other_kind = value.to_string(),
        _ => {}
    })?;
    m.kind = if event_type.is_empty() {
        other_kind
    } else {
        event_type
    };
    Ok(m)
}

/// Calls `each` with every string header (other types are skipped).
fn read_headers(mut h: &[u8], mut each: impl FnMut(&[u8], &str)) -> Result<(), FrameError> {
    let bad = FrameError::Malformed("a header");
    while let Some((&name_len, rest)) = h.split_first() {
        let name_len = usize::from(name_len);
        let name = rest.get(..name_len).ok_or(bad.clone())?;
        let (&kind, rest) = rest
            .get(name_len..)
            .and_then(<[u8]>::split_first)
            .ok_or(bad.clone())?;
        let fixed = match kind {
            0 | 1 => Some(0),
            2 => Some(1),
            3 => Some(2),
            4 => Some(4),
            5 | 8 => Some(8),
            9 => Some(16),
            6 | 7 => None,
            _ => return Err(bad),
        };
        h = match fixed {
            Some(n) => rest.get(n..).ok_or(bad.clone())?,
            None => {
                let len = rest
                    .get(..2)
                    .and_then(|b| <[u8; 2]>::try_from(b).ok())
                    .map(|b| usize::from(u16::from_be_bytes(b)))
                    .ok_or(bad.clone())?;
                let value = rest.get(2..2 + len).ok_or(bad.clone())?;
                if kind == 7 {
                    each(name, std::str::from_utf8(value).map_err(|_| bad.clone())?);
                }
                rest.get(2 + len..).ok_or(bad.clone())?
            }
        };
    }
    Ok(())
}

/// Encodes a message with string headers (tests and the simulators' counterpart).
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::new();
    for (name, value) in headers {
        h.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        h.extend_from_slice(name.as_bytes());
        h.push(7);
        h.extend_from_slice(&u16::try_from(value.len()).unwrap_or(u16::MAX).to_be_bytes());
        h.extend_from_slice(value.as_bytes());
    }
    let total = OVERHEAD + h.len() + payload.len();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&u32::try_from(total).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&u32::try_from(h.len()).unwrap_or(u32::MAX).to_be_bytes());
    let prelude_crc = crc(&out);
    out.extend_from_slice(&prelude_crc.to_be_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    let message_crc = crc(&out);
    out.extend_from_slice(&message_crc.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, payload: &str) -> Vec<u8> {
        encode(
            &[
                (":event-type", kind),
                (":content-type", "application/json"),
                (":message-type", "event"),
            ],
            payload.as_bytes(),
        )
    }

    /// AWS's documented example: a message with no headers and no payload is 16 bytes whose
    /// prelude CRC is 0x05c248eb and message CRC 0x7d98c8ff.
    #[test]
    fn the_empty_message_matches_aws() {
        let m = encode(&[], b"");
        assert_eq!(
            m,
            [
                0, 0, 0, 0x10, 0, 0, 0, 0, 0x05, 0xc2, 0x48, 0xeb, 0x7d, 0x98, 0xc8, 0xff
            ]
        );
        let (msgs, err) = Decoder::default().feed(&m);
        assert_eq!((msgs.len(), err), (1, None));
    }

    #[test]
    fn messages_split_anywhere_are_decoded_once_whole() {
        let mut stream = event("messageStart", r#"{"role":"assistant"}"#);
        stream.extend(event("contentBlockDelta", r#"{"delta":{"text":"hi"}}"#));
        for cut in 0..stream.len() {
            let mut d = Decoder::default();
            let (mut msgs, e1) = d.feed(&stream[..cut]);
            let (more, e2) = d.feed(&stream[cut..]);
            msgs.extend(more);
            assert_eq!((e1, e2), (None, None), "{cut}");
            let kinds: Vec<_> = msgs.iter().map(|m| m.kind.as_str()).collect();
            assert_eq!(kinds, ["messageStart", "contentBlockDelta"], "{cut}");
            assert_eq!(msgs[1].payload, br#"{"delta":{"text":"hi"}}"#);
            assert_eq!(msgs[0].message_type, "event");
            assert_eq!(d.carried(), 0);
        }
        // Byte by byte.
        let mut d = Decoder::default();
        let n: usize = stream.iter().map(|b| d.feed(&[*b]).0.len()).sum();
        assert_eq!(n, 2);
    }

    #[test]
    fn corrupt_or_oversized_messages_end_the_stream() {
        let good = event("messageStop", r#"{"stopReason":"end_turn"}"#);
        let mut bad = good.clone();
        let last = bad.len() - 6;
        bad[last] ^= 1;
        let (msgs, err) = Decoder::default().feed(&[good.clone(), bad].concat());
        assert_eq!((msgs.len(), err), (1, Some(FrameError::MessageCrc)));
        let mut bad = good.clone();
        bad[2] ^= 1;
        assert_eq!(
            Decoder::default().feed(&bad).1,
            Some(FrameError::PreludeCrc)
        );
        let mut huge = ((FRAME_CAP + 1) as u32).to_be_bytes().to_vec();
        huge.extend(0u32.to_be_bytes());
        huge.extend(crc(&huge).to_be_bytes());
        assert_eq!(
            Decoder::default().feed(&huge).1,
            Some(FrameError::TooLarge(FRAME_CAP + 1))
        );
    }
}
