//! Fetch the default model into the cache (if absent) and print its path.

fn main() {
    match bulkhead_fetch::ensure_default_model(true) {
        Ok(p) => println!("{}", p.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
