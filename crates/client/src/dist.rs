//! Seeded randomness for reproducible workloads: a small generator, length distributions,
//! filler text and random codes. The same seed and request index always give the same
//! prompt, whatever the concurrency or the order requests finish in.

use std::str::FromStr;

use serde::Serialize;

/// SplitMix64: tiny, fast, and plenty for workloads (not for secrets).
#[derive(Debug, Clone)]
pub struct Rng(u64);

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The generator of item `index` of a run seeded with `seed`: independent of how many
    /// draws other items made.
    pub fn for_index(seed: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ Rng(index.wrapping_mul(GOLDEN)).next_u64());
        r.next_u64();
        r
    }

    /// A fresh seed from the clock and the process id (for runs that ask for none); 32 bits,
    /// so it is short to retype and exact in any JSON reader.
    pub fn entropy() -> u64 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Rng(t ^ u64::from(std::process::id()).rotate_left(32)).next_u64() >> 32
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0) has no value");
        // Multiply-shift: bias below 2^-64 * n, irrelevant here.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A standard normal draw (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit(); // (0, 1]: ln is finite
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// A distribution of lengths (tokens), always at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Dist {
    /// Always this value.
    Fixed {
        /// The value.
        value: u32,
    },
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest value.
        min: u32,
        /// Largest value.
        max: u32,
    },
    /// Normal, rounded, clamped to `1..=2*mean`.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

impl Dist {
    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> u32 {
        match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { min, max } => min + rng.below(u64::from(max - min) + 1) as u32,
            Dist::Normal { mean, std } => (mean + std * rng.normal()).round().clamp(1.0, (2.0 * mean).max(1.0)) as u32,
        }
    }

    /// The mean of the distribution.
    pub fn mean(&self) -> f64 {
        match *self {
            Dist::Fixed { value } => f64::from(value),
            Dist::Uniform { min, max } => (f64::from(min) + f64::from(max)) / 2.0,
            Dist::Normal { mean, .. } => mean,
        }
    }
}

impl FromStr for Dist {
    type Err = String;

    /// `N`, `uniform:MIN:MAX` or `normal:MEAN:STD`.
    fn from_str(s: &str) -> Result<Dist, String> {
        let bad = || format!("invalid length distribution `{s}`: expected N, uniform:MIN:MAX or normal:MEAN:STD (N, MIN >= 1)");
        let parts: Vec<&str> = s.split(':').map(str::trim).collect();
        let d = match parts.as_slice() {
            [n] => Dist::Fixed { value: n.parse().map_err(|_| bad())? },
            ["uniform", a, b] => Dist::Uniform { min: a.parse().map_err(|_| bad())?, max: b.parse().map_err(|_| bad())? },
            ["normal", m, sd] => Dist::Normal { mean: m.parse().map_err(|_| bad())?, std: sd.parse().map_err(|_| bad())? },
            _ => return Err(bad()),
        };
        let ok = match d {
            Dist::Fixed { value } => value >= 1,
            Dist::Uniform { min, max } => min >= 1 && min <= max,
            Dist::Normal { mean, std } => mean >= 1.0 && mean.is_finite() && std >= 0.0 && std.is_finite(),
        };
        if ok { Ok(d) } else { Err(bad()) }
    }
}

impl std::fmt::Display for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dist::Fixed { value } => write!(f, "{value}"),
            Dist::Uniform { min, max } => write!(f, "uniform:{min}:{max}"),
            Dist::Normal { mean, std } => write!(f, "normal:{mean}:{std}"),
        }
    }
}

/// Common English words, each one token (with its leading space) in GPT-2-style BPE
/// vocabularies, so `n` words make a prompt of about `n` tokens.
const WORDS: &[&str] = &[
    "time", "people", "water", "house", "world", "light", "river", "stone", "green", "small", "city", "night", "morning", "paper", "music",
    "garden", "window", "table", "road", "field", "winter", "summer", "school", "market", "story", "friend", "mother", "father", "forest",
    "mountain", "ocean", "bread", "coffee", "bridge", "train", "letter", "number", "color", "animal", "bird", "horse", "dog", "cat",
    "tree", "flower", "sun", "moon", "star", "cloud", "rain", "snow", "wind", "fire", "gold", "silver", "iron", "glass", "wood", "door",
    "wall", "floor", "room", "kitchen", "street", "village", "country", "island", "lake", "valley", "hill", "north", "south", "east",
    "west", "red", "blue", "yellow", "black", "white", "old", "new", "young", "happy", "quiet", "strong", "simple", "early", "late",
    "open", "walk", "run", "read", "write", "build", "carry", "watch", "listen", "think", "learn", "teach", "begin", "follow", "money",
    "family", "game", "power", "heart", "voice", "name", "dream", "sea", "sky", "king", "queen", "book", "song", "ship", "farm", "car",
    "boat", "shop", "church", "line", "place", "hand", "head", "eye", "face", "body",
];

/// `n` random words separated by spaces (about `n` tokens).
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
    }
    s
}

/// Parts of [`sentences`].
const NOUNS: &[&str] = &[
    "river", "stone", "garden", "window", "table", "road", "field", "market", "story", "friend", "mother", "father", "forest", "mountain",
    "ocean", "bridge", "train", "letter", "animal", "bird", "horse", "dog", "cat", "tree", "flower", "cloud", "village", "island", "lake",
    "valley", "hill", "kitchen", "street", "ship", "farm", "boat", "shop",
];
const ADJECTIVES: &[&str] = &[
    "green", "small", "quiet", "old", "new", "young", "happy", "strong", "simple", "red", "blue", "yellow", "black", "white", "early",
    "late",
];
const VERBS: &[&str] = &["sees", "finds", "watches", "follows", "carries", "builds", "reads", "writes", "paints", "visits"];
const PLACES: &[&str] = &["near", "by", "under", "behind", "in", "across"];

/// Simple sentences ("The quiet river follows the dog near the farm.") of about `n` words
/// in all: filler a small model reads like text, unlike a bag of words, so it keeps
/// attending to what came before it.
pub fn sentences(rng: &mut Rng, n: usize) -> String {
    let mut pick = |list: &[&'static str]| list[rng.below(list.len() as u64) as usize];
    let mut s = String::with_capacity(n * 6);
    let mut count = 0;
    while count < n {
        if count > 0 {
            s.push(' ');
        }
        let parts = ["The", pick(ADJECTIVES), pick(NOUNS), pick(VERBS), "the", pick(NOUNS), pick(PLACES), "the", pick(NOUNS)];
        s.push_str(&parts.join(" "));
        s.push('.');
        count += parts.len();
    }
    s
}

/// A random code of `len` decimal digits, e.g. `7595518512`. Digits are one token each in
/// common tokenizers, so a model copying the code reproduces the prompt's tokens exactly
/// (with letters, a cue that splits a multi-letter token throws a small model off).
pub fn code(rng: &mut Rng, len: usize) -> String {
    (0..len).map(|_| char::from(b'0' + rng.below(10) as u8)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_and_index_give_the_same_text_and_others_differ() {
        let a = words(&mut Rng::for_index(42, 7), 50);
        assert_eq!(a, words(&mut Rng::for_index(42, 7), 50));
        assert_ne!(a, words(&mut Rng::for_index(42, 8), 50));
        assert_ne!(a, words(&mut Rng::for_index(43, 7), 50));
        assert_eq!(a.split(' ').count(), 50);
        let s = sentences(&mut Rng::for_index(42, 7), 50);
        assert_eq!(s, sentences(&mut Rng::for_index(42, 7), 50));
        assert!(s.starts_with("The ") && s.ends_with('.') && (50..59).contains(&s.split(' ').count()), "{s}");
        assert_eq!(code(&mut Rng::new(1), 10), code(&mut Rng::new(1), 10));
        assert!(code(&mut Rng::new(1), 10).bytes().all(|b| b.is_ascii_digit()));
    }

    #[test]
    fn distributions_parse_and_stay_in_range() {
        let mut r = Rng::new(9);
        assert_eq!("128".parse::<Dist>().unwrap().sample(&mut r), 128);
        let u: Dist = "uniform:10:20".parse().unwrap();
        let draws: Vec<u32> = (0..2000).map(|_| u.sample(&mut r)).collect();
        assert!(draws.iter().all(|&x| (10..=20).contains(&x)));
        assert!(draws.contains(&10) && draws.contains(&20), "both ends are reachable");
        let n: Dist = "normal:100:10".parse().unwrap();
        let draws: Vec<f64> = (0..20_000).map(|_| f64::from(n.sample(&mut r))).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let sd = (draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / draws.len() as f64).sqrt();
        assert!((mean - 100.0).abs() < 0.5 && (sd - 10.0).abs() < 0.5, "mean {mean} sd {sd}");
        assert!("normal:3:100".parse::<Dist>().unwrap().sample(&mut r) >= 1, "never below 1");
        for bad in ["0", "uniform:5:4", "uniform:0:4", "normal:0:1", "normal:5:-1", "zipf:1:2", "x", ""] {
            assert!(bad.parse::<Dist>().is_err(), "{bad}");
        }
        assert_eq!("uniform:1:3".parse::<Dist>().unwrap().to_string(), "uniform:1:3");
    }

    #[test]
    fn uniform_draws_are_not_lopsided() {
        let mut r = Rng::new(3);
        let mut counts = [0u32; 4];
        for _ in 0..40_000 {
            counts[r.below(4) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (9_500..10_500).contains(&c)), "{counts:?}");
    }
}
