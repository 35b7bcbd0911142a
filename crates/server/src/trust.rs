//! Cluster trust at the process edge (issue 18): where the cluster key comes from, and
//! which listeners may run without one. The handshake and the frame MACs themselves are
//! sans-IO, in [`bulkhead_protocol::auth`]; [`crate::wire`] runs them over sockets.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bulkhead_protocol::auth::{ClusterKey, KEY_LEN};

/// How this process's internal connections are secured.
#[derive(Clone, Debug, Default)]
pub struct Trust {
    /// The cluster key; `None`: no handshake, no MACs.
    pub key: Option<Arc<ClusterKey>>,
    /// `--insecure-cluster`: internal listeners may face the network without a key.
    pub insecure: bool,
}

/// Why the cluster's trust settings refuse to start.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("cannot read the cluster key file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("the cluster key file {path} is readable or writable by others (mode {mode:o}); run `chmod 600 {path}`")]
    Permissions { path: String, mode: u32 },
    #[error("the cluster key file {path} does not hold a key: {source}")]
    Format { path: String, source: bulkhead_protocol::auth::AuthError },
    #[error(
        "the {what} listens on {addr}, which is not a loopback address, and this cluster has no key: \
         anyone who reaches it could join the cluster. Pass --cluster-key-file FILE (make one with \
         `bulkhead keygen FILE`) on every process of the cluster, or --insecure-cluster to accept the risk"
    )]
    OpenListener { what: &'static str, addr: SocketAddr },
    #[error("cannot make a random key: {0}")]
    Random(String),
}

impl Trust {
    /// A cluster with `key`.
    pub fn with_key(key: ClusterKey) -> Self {
        Trust { key: Some(Arc::new(key)), insecure: false }
    }

    /// Fail closed: an internal listener on a non-loopback address needs a key, unless
    /// `--insecure-cluster` says otherwise (logged loudly).
    pub fn check_listener(&self, what: &'static str, addr: SocketAddr) -> Result<(), TrustError> {
        if self.key.is_some() || addr.ip().is_loopback() {
            return Ok(());
        }
        if self.insecure {
            tracing::error!(%addr, what, "INSECURE CLUSTER: this internal listener faces the network without a cluster key; any process that reaches it can join the cluster and write KV (--insecure-cluster)");
            return Ok(());
        }
        Err(TrustError::OpenListener { what, addr })
    }

    /// What the start-up log line says about internal connections.
    pub fn describe(&self) -> &'static str {
        match (&self.key, self.insecure) {
            (Some(_), _) => "cluster key: mutual authentication and a MAC on every internal frame; frames are not encrypted",
            (None, true) => "NO cluster key (--insecure-cluster): internal connections are not authenticated",
            (None, false) => "no cluster key: internal connections are not authenticated (loopback only)",
        }
    }
}

/// Read a key file: 64 hexadecimal digits, and not readable by group or others.
pub fn load_key_file(path: &Path) -> Result<ClusterKey, TrustError> {
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|source| TrustError::Read { path: shown.clone(), source })?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TrustError::Permissions { path: shown, mode });
        }
    }
    #[cfg(not(unix))]
    let _ = meta;
    let text = std::fs::read_to_string(path).map_err(|source| TrustError::Read { path: shown.clone(), source })?;
    ClusterKey::from_hex(&text).map_err(|source| TrustError::Format { path: shown, source })
}

/// A new random key.
pub fn generate_key() -> Result<ClusterKey, TrustError> {
    Ok(ClusterKey::from_bytes(random()?))
}

/// Write a new random key to `path`, readable by its owner only; refuses to overwrite.
pub fn write_key_file(path: &Path) -> Result<(), TrustError> {
    use std::io::Write;
    let key = generate_key()?;
    let shown = path.display().to_string();
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|source| TrustError::Read { path: shown.clone(), source })?;
    writeln!(f, "{}", key.to_hex()).map_err(|source| TrustError::Read { path: shown, source })
}

/// 32 random bytes from the operating system: keys and handshake nonces.
pub fn random() -> Result<[u8; KEY_LEN], TrustError> {
    let mut b = [0u8; KEY_LEN];
    getrandom::fill(&mut b).map_err(|e| TrustError::Random(e.to_string()))?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_listener_needs_a_key_or_the_insecure_flag() {
        let open: SocketAddr = "0.0.0.0:9000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let none = Trust::default();
        assert!(none.check_listener("KV port", local).is_ok());
        let err = none.check_listener("KV port", open).unwrap_err().to_string();
        assert!(err.contains("--cluster-key-file") && err.contains("0.0.0.0:9000"), "{err}");
        assert!(Trust { key: None, insecure: true }.check_listener("KV port", open).is_ok());
        assert!(Trust::with_key(ClusterKey::from_bytes([1; 32])).check_listener("KV port", open).is_ok());
    }

    #[cfg(unix)]
    #[test]
    fn a_key_file_is_made_private_read_back_and_refused_when_others_can_read_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("bulkhead-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cluster.key");
        let _ = std::fs::remove_file(&path);
        write_key_file(&path).unwrap();
        assert!(write_key_file(&path).is_err(), "never overwrites a key");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        load_key_file(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_key_file(&path).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
        std::fs::write(&path, "not a key").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(load_key_file(&path), Err(TrustError::Format { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
