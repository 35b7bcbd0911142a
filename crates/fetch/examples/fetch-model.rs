//! Fetch the models named on the command line (default: every known one) into the cache, if
//! absent, and print their paths.

fn main() {
    let names: Vec<String> = std::env::args().skip(1).collect();
    let models: Vec<&bulkhead_fetch::KnownModel> = if names.is_empty() {
        bulkhead_fetch::KNOWN.iter().collect()
    } else {
        names
            .iter()
            .map(|n| {
                bulkhead_fetch::known(n).unwrap_or_else(|| {
                    eprintln!(
                        "error: unknown model {n} (known: {})",
                        bulkhead_fetch::KNOWN.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
                    );
                    std::process::exit(2)
                })
            })
            .collect()
    };
    for m in models {
        match bulkhead_fetch::ensure(m, true) {
            Ok(p) => println!("{}", p.display()),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
    }
}
