//! Tenants: who a request belongs to, from its API key and never from its body (design I7).
//!
//! `--tenants FILE` names one `[[tenant]]` table per tenant:
//!
//! ```toml
//! [[tenant]]
//! name = "acme"
//! api_key_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
//!
//! [[tenant]]
//! name = "globex"
//! api_keys = ["sk-globex-1"]          # plain keys work too; digests are recommended
//! weight = 2                          # its share of the queue: twice a weight-1 tenant's (default 1)
//! max_concurrent_requests = 8         # in flight at once, queued or running (default: no limit)
//! tokens_per_minute = 200000          # prompt + max_tokens charged at admission, unused refunded
//! ```
//!
//! Over a limit a request gets 429 with `Retry-After` and an OpenAI error body naming the
//! limit (`concurrency_limit_exceeded`, `tokens_per_minute_exceeded`). Limits hold per
//! gateway.
//!
//! `Authorization: Bearer <key>` picks the tenant. Keys are compared as SHA-256 digests,
//! against every configured digest, in constant time: how long the check takes says
//! nothing about which key, or how much of one, matched. Without tenants (neither
//! `--tenants` nor `--api-key`) every request belongs to one tenant named `default` and
//! nothing is checked.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::{HeaderMap, header};
use bulkhead_protocol::gateway::{TenantId, TenantPolicy};
use serde::Deserialize;

use crate::error::ApiError;

/// Longest tenant name accepted in a tenants file (names reach logs and metrics).
pub const MAX_TENANT_NAME: usize = 64;

/// The tenant of a request: its number (for the gateway's fair queue) and its name (for
/// logs). A request extension set by the authentication middleware.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Index in the tenants file, from 0.
    pub id: u32,
    /// Its name.
    pub name: Arc<str>,
}

/// Why a tenants file was refused.
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    /// It could not be read.
    #[error("reading the tenants file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is not valid TOML of the expected shape.
    #[error("the tenants file is not valid: {0}")]
    Parse(String),
    /// What is wrong in which file.
    #[error("the tenants file {path}: {source}")]
    InFile {
        /// The file.
        path: String,
        /// What is wrong.
        source: Box<TenantsError>,
    },
    /// A tenant is not usable.
    #[error("tenant {name:?}: {why}")]
    Tenant {
        /// Its name.
        name: String,
        /// What is wrong.
        why: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tenant: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    #[serde(default)]
    api_keys: Vec<String>,
    #[serde(default)]
    api_key_sha256: Vec<String>,
    weight: Option<i64>,
    max_concurrent_requests: Option<i64>,
    tokens_per_minute: Option<i64>,
}

/// The configured tenants and their key digests.
#[derive(Debug)]
pub struct Tenants {
    /// `(tenant, SHA-256 of one of its keys)`, every key of every tenant; empty when
    /// nothing is checked.
    keys: Vec<(u32, [u8; 32])>,
    names: Vec<Arc<str>>,
    /// Each tenant's share and limits, by index.
    policies: Vec<TenantPolicy>,
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn hex32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Whether `headers` carry exactly one bearer token whose SHA-256 is `digest` (compared
/// in constant time): the operator's key for its own pages.
pub fn bearer_matches(headers: &HeaderMap, digest: &[u8; 32]) -> bool {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(v), None) = (values.next(), values.next()) else { return false };
    let Some(token) =
        v.to_str().ok().and_then(|v| v.split_once(' ')).filter(|(s, _)| s.eq_ignore_ascii_case("bearer")).map(|(_, t)| t.trim())
    else {
        return false;
    };
    constant_time_eq::constant_time_eq(&sha256(token.as_bytes()), digest)
}

/// The SHA-256 of a key, as [`bearer_matches`] compares it.
pub fn key_digest(key: &str) -> [u8; 32] {
    sha256(key.as_bytes())
}

impl Tenants {
    /// No authentication: one tenant, `default`.
    pub fn open() -> Self {
        Tenants { keys: Vec::new(), names: vec![Arc::from("default")], policies: vec![TenantPolicy::default()] }
    }

    /// One tenant, `default`, whose key is `key` (vLLM's `--api-key`).
    pub fn single_key(key: &str) -> Result<Self, TenantsError> {
        if key.is_empty() {
            return Err(TenantsError::Tenant { name: "default".into(), why: "the API key is empty".into() });
        }
        Ok(Tenants { keys: vec![(0, sha256(key.as_bytes()))], names: vec![Arc::from("default")], policies: vec![TenantPolicy::default()] })
    }

    /// Tenants from the text of a tenants file (see the module docs).
    pub fn from_toml(text: &str) -> Result<Self, TenantsError> {
        let file: File = toml::from_str(text).map_err(|e| TenantsError::Parse(e.to_string()))?;
        if file.tenant.is_empty() {
            return Err(TenantsError::Parse("no [[tenant]] table".into()));
        }
        let mut t = Tenants { keys: Vec::new(), names: Vec::new(), policies: Vec::new() };
        for (i, e) in file.tenant.into_iter().enumerate() {
            let bad = |why: &str| TenantsError::Tenant { name: e.name.clone(), why: why.into() };
            let name_ok = !e.name.is_empty()
                && e.name.len() <= MAX_TENANT_NAME
                && e.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !name_ok {
                return Err(bad("a name is 1 to 64 characters of ASCII letters, digits, '-', '_' or '.'"));
            }
            if t.names.iter().any(|n| **n == *e.name) {
                return Err(bad("the name is used twice"));
            }
            if e.api_keys.is_empty() && e.api_key_sha256.is_empty() {
                return Err(bad("no api_keys and no api_key_sha256"));
            }
            let id = u32::try_from(i).map_err(|_| bad("too many tenants"))?;
            for k in &e.api_keys {
                if k.is_empty() {
                    return Err(bad("an empty API key"));
                }
                t.keys.push((id, sha256(k.as_bytes())));
            }
            for h in &e.api_key_sha256 {
                t.keys.push((id, hex32(h).ok_or_else(|| bad("api_key_sha256 holds 64 hex digits (a SHA-256 digest)"))?));
            }
            // At least 1, and within u32 (weights, concurrency) or u64 (tokens).
            let positive = |field: &str, v: Option<i64>| match v {
                None => Ok(None),
                Some(x) if x >= 1 => Ok(Some(x)),
                Some(x) => Err(bad(&format!("{field} = {x}: it must be at least 1"))),
            };
            let small = |field: &str, v: Option<i64>| {
                positive(field, v)?.map(|x| u32::try_from(x).map_err(|_| bad(&format!("{field} = {x}: at most {}", u32::MAX)))).transpose()
            };
            let policy = TenantPolicy {
                weight: small("weight", e.weight)?.unwrap_or(1),
                max_concurrent_requests: small("max_concurrent_requests", e.max_concurrent_requests)?,
                tokens_per_minute: positive("tokens_per_minute", e.tokens_per_minute)?.map(|x| x.unsigned_abs()),
            };
            t.names.push(Arc::from(e.name.as_str()));
            t.policies.push(policy);
        }
        let mut digests: Vec<[u8; 32]> = t.keys.iter().map(|k| k.1).collect();
        digests.sort_unstable();
        if digests.windows(2).any(|w| w[0] == w[1]) {
            return Err(TenantsError::Parse("one API key is configured twice (it would name two tenants)".into()));
        }
        Ok(t)
    }

    /// Tenants from the file at `path`; an error names the file.
    pub fn load(path: &std::path::Path) -> Result<Self, TenantsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TenantsError::Read { path: path.display().to_string(), source })?;
        Self::from_toml(&text).map_err(|e| TenantsError::InFile { path: path.display().to_string(), source: Box::new(e) })
    }

    /// Each tenant's share of the queue and limits, for the gateway.
    pub fn policies(&self) -> BTreeMap<TenantId, TenantPolicy> {
        self.policies.iter().enumerate().filter_map(|(i, p)| Some((TenantId(u32::try_from(i).ok()?), *p))).collect()
    }

    /// Whether requests must carry a key.
    pub fn authenticates(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Tenants configured.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Never true: there is always at least one tenant.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The tenant of a request with these headers; 401 `invalid_api_key` when keys are
    /// configured and the request has none or an unknown one.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Tenant, ApiError> {
        if !self.authenticates() {
            return Ok(Tenant { id: 0, name: Arc::clone(&self.names[0]) });
        }
        // Two keys would leave which one picks the tenant to the order of the headers, and a
        // proxy in front may read the other one.
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let first = values.next();
        if values.next().is_some() {
            return Err(ApiError::invalid_api_key("Send one Authorization header: this request has several."));
        }
        // The scheme is case-insensitive (RFC 7235); the key is not.
        let presented = first
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim())
            .filter(|k| !k.is_empty());
        let Some(key) = presented else {
            return Err(ApiError::invalid_api_key("Missing API key: send it as `Authorization: Bearer <key>`."));
        };
        let digest = sha256(key.as_bytes());
        // Every digest is compared, whichever matches: the time does not depend on it.
        let mut found: Option<u32> = None;
        for (id, d) in &self.keys {
            if constant_time_eq::constant_time_eq_32(d, &digest) {
                found = Some(*id);
            }
        }
        match found.and_then(|id| Some(Tenant { id, name: Arc::clone(self.names.get(id as usize)?) })) {
            Some(t) => Ok(t),
            None => Err(ApiError::invalid_api_key("Incorrect API key provided.")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(k: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, format!("Bearer {k}").parse().unwrap());
        h
    }

    #[test]
    fn weights_and_limits_are_read_and_bad_ones_refused_naming_the_tenant_and_field() {
        let t = Tenants::from_toml(
            "[[tenant]]\nname = \"a\"\napi_keys = [\"ka\"]\nweight = 3\nmax_concurrent_requests = 8\ntokens_per_minute = 100000\n\
             [[tenant]]\nname = \"b\"\napi_keys = [\"kb\"]\n",
        )
        .unwrap();
        let p = t.policies();
        assert_eq!(p[&TenantId(0)], TenantPolicy { weight: 3, max_concurrent_requests: Some(8), tokens_per_minute: Some(100_000) });
        assert_eq!(p[&TenantId(1)], TenantPolicy::default());
        for (field, value) in [("weight", "0"), ("weight", "-2"), ("max_concurrent_requests", "-1"), ("tokens_per_minute", "0")] {
            let e = Tenants::from_toml(&format!("[[tenant]]\nname = \"a\"\napi_keys = [\"ka\"]\n{field} = {value}\n")).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("\"a\"") && text.contains(field) && text.contains("at least 1"), "{text}");
        }
        let e = Tenants::from_toml("[[tenant]]\nname = \"a\"\napi_keys = [\"ka\"]\nwieght = 2\n").unwrap_err();
        assert!(e.to_string().contains("wieght"), "{e}");
        let path = std::env::temp_dir().join(format!("bulkhead-tenants-test-{}.toml", std::process::id()));
        std::fs::write(&path, "[[tenant]]\nname = \"a\"\napi_keys = [\"ka\"]\nweight = 0\n").unwrap();
        let e = Tenants::load(&path).unwrap_err().to_string();
        let _ = std::fs::remove_file(&path);
        assert!(e.contains(&path.display().to_string()) && e.contains("weight"), "the file is named: {e}");
    }

    #[test]
    fn keys_pick_their_tenant_and_anything_else_is_401() {
        let digest: String = sha256(b"sk-b").iter().map(|b| format!("{b:02x}")).collect();
        let t = Tenants::from_toml(&format!(
            "[[tenant]]\nname = \"a\"\napi_keys = [\"sk-a\"]\n[[tenant]]\nname = \"b\"\napi_key_sha256 = [\"{digest}\"]\n"
        ))
        .unwrap();
        assert_eq!(t.authenticate(&bearer("sk-a")).unwrap(), Tenant { id: 0, name: "a".into() });
        assert_eq!(t.authenticate(&bearer("sk-b")).unwrap(), Tenant { id: 1, name: "b".into() });
        for h in [bearer("sk-c"), bearer("sk-"), bearer("x"), HeaderMap::new()] {
            let e = t.authenticate(&h).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (401, Some("invalid_api_key")));
        }
        for scheme in ["bearer", "BEARER", "bEaReR"] {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, format!("{scheme} sk-a").parse().unwrap());
            assert_eq!(t.authenticate(&h).unwrap().name.as_ref(), "a", "{scheme}");
        }
        let mut two = bearer("sk-a");
        two.append(header::AUTHORIZATION, "Bearer sk-b".parse().unwrap());
        let e = t.authenticate(&two).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (401, Some("invalid_api_key")));
        assert!(e.message.contains("one Authorization header"), "{}", e.message);
        // Open: everyone is `default`.
        assert_eq!(Tenants::open().authenticate(&HeaderMap::new()).unwrap().name.as_ref(), "default");
        assert!(Tenants::single_key("k").unwrap().authenticate(&HeaderMap::new()).is_err());
    }

    #[test]
    fn a_bad_tenants_file_is_refused_with_the_reason() {
        for (text, why) in [
            ("", "no [[tenant]]"),
            ("[[tenant]]\nname = \"a\"\n", "no api_keys"),
            ("[[tenant]]\nname = \"a b\"\napi_keys = [\"k\"]\n", "a name is"),
            ("[[tenant]]\nname = \"a\"\napi_key_sha256 = [\"abc\"]\n", "64 hex digits"),
            ("[[tenant]]\nname = \"a\"\napi_keys = [\"k\"]\n[[tenant]]\nname = \"b\"\napi_keys = [\"k\"]\n", "configured twice"),
            ("[[tenant]]\nname = \"a\"\napi_keys = [\"k\"]\n[[tenant]]\nname = \"a\"\napi_keys = [\"j\"]\n", "used twice"),
            ("[[tenant]]\nname = \"a\"\napi_keys = [\"k\"]\nsalt = 1\n", "unknown field"),
        ] {
            let e = Tenants::from_toml(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }
}
