//! W3C Trace Context (`traceparent`): each request continues the client's trace, or starts
//! one, under a span id of its own. The trace id goes into every log line of the request,
//! on the gateway and on the workers, and back to the client in the response's
//! `traceparent` header.
//!
//! A malformed header is ignored (a new trace starts), never an error: tracing must not
//! change whether a request is served.

use std::fmt;

use axum::http::{HeaderMap, HeaderName};

use crate::ids::random_u128;

/// The `traceparent` header, read on requests and set on responses.
pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// A W3C trace id: 16 bytes, never all zero, written as 32 lowercase hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A request's place in a trace: the trace, this request's span id and the trace flags.
/// Displays as a version-00 `traceparent` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace.
    pub trace_id: TraceId,
    /// This span (the parent of anything it calls).
    pub span_id: [u8; 8],
    /// Trace flags; bit 0 is "sampled".
    pub flags: u8,
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-", self.trace_id)?;
        self.span_id.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, "-{:02x}", self.flags)
    }
}

/// `N` bytes from exactly `2N` lowercase hex digits (the spec allows no uppercase).
fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let b = s.as_bytes();
    if b.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = digit(b[2 * i])? << 4 | digit(b[2 * i + 1])?;
    }
    Some(out)
}

impl TraceParent {
    /// Parses a `traceparent` value: `version-traceid-parentid-flags`, lowercase hex,
    /// version not `ff`, ids not all zero. Version 00 is exactly 55 characters; a later
    /// version may append `-` and more, which is ignored (as the spec asks).
    pub fn parse(s: &str) -> Option<TraceParent> {
        let head = s.get(..55)?;
        let version = hex::<1>(s.get(..2)?)?[0];
        let rest = &s[55..];
        let tail_ok = if version == 0 { rest.is_empty() } else { rest.is_empty() || rest.starts_with('-') };
        if version == 0xff || !tail_ok {
            return None;
        }
        let mut parts = head.split('-');
        let (_, trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let trace_id = hex::<16>(trace).filter(|t| *t != [0; 16])?;
        let span_id = hex::<8>(parent).filter(|p| *p != [0; 8])?;
        Some(TraceParent { trace_id: TraceId(trace_id), span_id, flags: hex::<1>(flags)?[0] })
    }

    /// This request's trace: the one named by a single valid `traceparent` header
    /// (keeping its sampled flag), or a new one; with a fresh span id either way.
    pub fn continue_or_start(headers: &HeaderMap) -> TraceParent {
        let mut values = headers.get_all(&TRACEPARENT).iter();
        let incoming = match (values.next(), values.next()) {
            (Some(v), None) => v.to_str().ok().and_then(TraceParent::parse),
            _ => None,
        };
        let span_id = fresh(|| (random_u128() as u64).to_le_bytes());
        match incoming {
            Some(p) => TraceParent { trace_id: p.trace_id, span_id, flags: p.flags & 1 },
            None => TraceParent { trace_id: TraceId(fresh(|| random_u128().to_le_bytes())), span_id, flags: 0 },
        }
    }
}

/// A random id that is not all zero (all zero means "none" in the spec).
fn fresh<const N: usize>(draw: impl Fn() -> [u8; N]) -> [u8; N] {
    loop {
        let id = draw();
        if id != [0; N] {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_header_parses_and_displays_back() {
        let p = TraceParent::parse(VALID).unwrap();
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert_eq!(p.flags, 1);
        assert_eq!(p.to_string(), VALID);
        // A later version may append fields.
        let future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
        assert_eq!(TraceParent::parse(future).map(|p| p.trace_id), Some(p.trace_id));
    }

    #[test]
    fn malformed_headers_are_refused() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "0é-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_request_continues_a_valid_trace_and_starts_one_otherwise() {
        let mut h = HeaderMap::new();
        h.insert(&TRACEPARENT, HeaderValue::from_static(VALID));
        let p = TraceParent::continue_or_start(&h);
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(p.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7], "a span of its own");
        for headers in [vec!["garbage"], vec![VALID, VALID], vec![]] {
            let mut h = HeaderMap::new();
            headers.iter().for_each(|v| {
                h.append(&TRACEPARENT, HeaderValue::from_static(v));
            });
            let a = TraceParent::continue_or_start(&h);
            let b = TraceParent::continue_or_start(&h);
            assert_ne!(a.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736", "{headers:?}");
            assert_ne!(a.trace_id, b.trace_id, "each new trace is new");
            assert_eq!(TraceParent::parse(&a.to_string()), Some(a), "what we send parses");
        }
    }
}
