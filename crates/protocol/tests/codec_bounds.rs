//! The frame size limit is inclusive: a payload of exactly the limit is a frame, one byte
//! more is refused before it is buffered (kills a `>` to `>=` mutant; docs/TESTING.md).

use bulkhead_protocol::{CodecError, FrameDecoder, Message, encode};

#[test]
fn a_payload_of_exactly_the_limit_is_accepted_and_one_byte_more_is_too_large() {
    let m = Message::Refuse { reason: "x".repeat(60) };
    let mut frame = Vec::new();
    encode(&m, &mut frame);
    let payload = frame.len() - 8;
    let mut d = FrameDecoder::new(payload);
    d.push(&frame);
    assert_eq!(d.next_message(), Ok(Some(m)));
    let mut d = FrameDecoder::new(payload - 1);
    d.push(&frame[..8]);
    assert_eq!(d.next_message(), Err(CodecError::TooLarge { len: payload, max: payload - 1 }));
}
