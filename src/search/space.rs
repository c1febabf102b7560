//! The search space: each key's distribution, as `[search.space]` of an experiment file gives it
//! (`"train.lr" = { log_uniform = [1e-4, 0.1] }`), and a trial's values in the two forms they take:
//! one float per key as the samplers see it (the value itself, or the index of a choice, as
//! Optuna's internal representation) and TOML as a pipeline takes it.
use super::math;
use crate::rng::Rng;

/// One key's distribution.
#[derive(Debug, Clone, PartialEq)]
pub enum Distribution {
    /// A float, uniform in [low, high].
    Uniform { low: f64, high: f64 },
    /// A float, uniform in log space: as likely in [1e-4, 1e-3] as in [1e-2, 1e-1].
    LogUniform { low: f64, high: f64 },
    /// An integer in [low, high], each as likely.
    Int { low: i64, high: i64 },
    /// An integer in [low, high], uniform in log space.
    LogInt { low: i64, high: i64 },
    /// One of the values (numbers, strings, lists such as `[64, 64]`).
    Choice(Vec<toml::Value>),
}

/// The distributions' names in an experiment file.
pub const KINDS: [&str; 5] = ["uniform", "log_uniform", "int", "log_int", "choice"];

/// One searched key and its distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub key: String,
    pub dist: Distribution,
}

/// The searched keys, in the experiment file's order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Space(pub Vec<Param>);

impl Distribution {
    /// Whether `value` is written as a distribution: a table of one key, a distribution's name.
    pub fn is_written(value: &toml::Value) -> bool {
        value.as_table().is_some_and(|t| t.len() == 1 && t.keys().all(|k| KINDS.contains(&k.as_str())))
    }

    /// Reads `{ uniform = [low, high] }`, `{ log_int = [16, 256] }`, `{ choice = [...] }`; `Err`
    /// says what is wrong with it.
    pub fn parse(value: &toml::Value) -> Result<Distribution, String> {
        let Some((kind, args)) = value.as_table().filter(|t| t.len() == 1).and_then(|t| t.iter().next()) else {
            return Err(format!(
                "expected a distribution such as {{ log_uniform = [0.0001, 0.1] }} (one of {}), got {value}",
                KINDS.join(", ")
            ));
        };
        let items = match args {
            toml::Value::Array(items) => items,
            other => return Err(format!("{kind} takes a list, e.g. {kind} = [{other}, ...]")),
        };
        if kind == "choice" {
            if items.is_empty() {
                return Err("choice = [] has no value to choose: give at least one".into());
            }
            if let Some((i, v)) = items.iter().enumerate().find(|(i, v)| items[..*i].contains(v)) {
                return Err(format!("choice lists {v} twice (values {} and {})", first(items, v) + 1, i + 1));
            }
            return Ok(Distribution::Choice(items.clone()));
        }
        let [low, high] = &items[..] else {
            return Err(format!("{kind} takes [low, high], two numbers, got {args}"));
        };
        let dist = match kind.as_str() {
            "uniform" | "log_uniform" => {
                let (low, high) = (float(low, kind)?, float(high, kind)?);
                if kind == "uniform" {
                    Distribution::Uniform { low, high }
                } else {
                    Distribution::LogUniform { low, high }
                }
            }
            "int" | "log_int" => {
                let (low, high) = (int(low, kind)?, int(high, kind)?);
                if kind == "int" {
                    Distribution::Int { low, high }
                } else {
                    Distribution::LogInt { low, high }
                }
            }
            other => {
                return Err(format!("unknown distribution `{other}`: use one of {}", KINDS.join(", ")));
            }
        };
        let (low, high) = dist.bounds();
        if low >= high {
            return Err(format!("{kind} = {args}: low ({}) must be below high ({})", items[0], items[1]));
        }
        if dist.is_log() && low <= 0.0 {
            return Err(format!("{kind} = {args}: a log scale needs bounds above 0, got {}", items[0]));
        }
        Ok(dist)
    }

    /// The bounds as given (a choice: its first and last index).
    pub fn bounds(&self) -> (f64, f64) {
        match self {
            Distribution::Uniform { low, high } | Distribution::LogUniform { low, high } => (*low, *high),
            Distribution::Int { low, high } | Distribution::LogInt { low, high } => (*low as f64, *high as f64),
            Distribution::Choice(values) => (0.0, (values.len() - 1) as f64),
        }
    }

    pub fn is_log(&self) -> bool {
        matches!(self, Distribution::LogUniform { .. } | Distribution::LogInt { .. })
    }

    /// How many values it holds, when they are countable (integers and choices).
    pub fn size(&self) -> Option<u128> {
        match self {
            Distribution::Int { low, high } | Distribution::LogInt { low, high } => Some((high - low) as u128 + 1),
            Distribution::Choice(values) => Some(values.len() as u128),
            _ => None,
        }
    }

    /// The value of the sampler's float `x`, as a pipeline takes it.
    pub fn value(&self, x: f64) -> toml::Value {
        match self {
            Distribution::Uniform { .. } | Distribution::LogUniform { .. } => toml::Value::Float(x),
            Distribution::Int { .. } | Distribution::LogInt { .. } => toml::Value::Integer(x as i64),
            Distribution::Choice(values) => values[x as usize].clone(),
        }
    }

    /// A draw of Optuna's `RandomSampler`: uniform in the (log) range; integers rounded from
    /// [low − ½, high + ½]; a choice's index.
    pub fn random(&self, rng: &mut Rng) -> f64 {
        match self {
            Distribution::Uniform { low, high } => (low + rng.uniform() * (high - low)).clamp(*low, *high),
            Distribution::LogUniform { low, high } => {
                let (a, b) = (math::ln(*low), math::ln(*high));
                math::exp(a + rng.uniform() * (b - a)).clamp(*low, *high)
            }
            Distribution::Int { low, high } => (*low + rng.below((high - low) as u64 + 1) as i64) as f64,
            Distribution::LogInt { low, high } => {
                let (a, b) = (math::ln(*low as f64 - 0.5), math::ln(*high as f64 + 0.5));
                math::exp(a + rng.uniform() * (b - a)).round().clamp(*low as f64, *high as f64)
            }
            Distribution::Choice(values) => rng.below(values.len() as u64) as f64,
        }
    }

    /// How the file writes it: `log_uniform [0.0001, 0.1]`, `choice [[16], [32, 32]]`.
    pub fn describe(&self) -> String {
        match self {
            Distribution::Uniform { low, high } => format!("uniform [{low}, {high}]"),
            Distribution::LogUniform { low, high } => format!("log_uniform [{low}, {high}]"),
            Distribution::Int { low, high } => format!("int [{low}, {high}]"),
            Distribution::LogInt { low, high } => format!("log_int [{low}, {high}]"),
            Distribution::Choice(values) => {
                format!("choice [{}]", values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", "))
            }
        }
    }
}

fn first(items: &[toml::Value], v: &toml::Value) -> usize {
    items.iter().position(|x| x == v).unwrap_or(0)
}

fn float(v: &toml::Value, kind: &str) -> Result<f64, String> {
    let x = match v {
        toml::Value::Float(x) => *x,
        toml::Value::Integer(i) => *i as f64,
        other => return Err(format!("{kind} takes numbers, got {other}")),
    };
    if !x.is_finite() {
        return Err(format!("{kind} takes finite bounds, got {x}"));
    }
    Ok(x)
}

fn int(v: &toml::Value, kind: &str) -> Result<i64, String> {
    match v {
        // Beyond ±2^53 an integer is no longer exact as the samplers' float.
        toml::Value::Integer(i) if i.unsigned_abs() <= 1 << 53 => Ok(*i),
        toml::Value::Integer(i) => Err(format!("{kind} takes integers of at most 2^53 in size, got {i}")),
        other => Err(format!("{kind} takes integers, got {other}")),
    }
}

impl Space {
    /// The keys and values of a point (one float per key), as a pipeline takes them.
    pub fn values(&self, point: &[f64]) -> Vec<(String, toml::Value)> {
        self.0.iter().zip(point).map(|(p, x)| (p.key.clone(), p.dist.value(*x))).collect()
    }

    /// How many points it holds, when every key's values are countable (and fewer than 2^64).
    pub fn size(&self) -> Option<u128> {
        self.0.iter().try_fold(1u128, |n, p| p.dist.size().and_then(|s| n.checked_mul(s)).filter(|n| *n < 1 << 64))
    }

    /// A random point (Optuna's `RandomSampler`, one key after another).
    pub fn random(&self, rng: &mut Rng) -> Vec<f64> {
        self.0.iter().map(|p| p.dist.random(rng)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Distribution, String> {
        let table: toml::Table = toml::from_str(&format!("d = {text}")).unwrap();
        Distribution::parse(&table["d"])
    }

    #[test]
    fn distributions_read_as_written() {
        assert_eq!(parse("{ uniform = [0, 0.5] }"), Ok(Distribution::Uniform { low: 0.0, high: 0.5 }));
        assert_eq!(parse("{ log_int = [16, 256] }"), Ok(Distribution::LogInt { low: 16, high: 256 }));
        let choice = parse("{ choice = [[16], [32, 32]] }").unwrap();
        assert_eq!(choice.size(), Some(2));
        assert_eq!(choice.value(1.0).to_string(), "[32, 32]");
        assert_eq!(choice.describe(), "choice [[16], [32, 32]]");
    }

    #[test]
    fn bad_distributions_say_what_is_wrong() {
        let e = |t: &str| parse(t).unwrap_err();
        assert_eq!(e("{ uniform = [0.1, 0.01] }"), "uniform = [0.1, 0.01]: low (0.1) must be below high (0.01)");
        assert_eq!(e("{ int = [4, 4] }"), "int = [4, 4]: low (4) must be below high (4)");
        assert_eq!(
            e("{ log_uniform = [0.0, 0.1] }"),
            "log_uniform = [0.0, 0.1]: a log scale needs bounds above 0, got 0.0"
        );
        assert_eq!(e("{ log_int = [-2, 8] }"), "log_int = [-2, 8]: a log scale needs bounds above 0, got -2");
        assert_eq!(e("{ int = [1.5, 8] }"), "int takes integers, got 1.5");
        assert_eq!(e("{ uniform = [1] }"), "uniform takes [low, high], two numbers, got [1]");
        assert_eq!(
            e("{ normal = [0, 1] }"),
            "unknown distribution `normal`: use one of uniform, log_uniform, int, log_int, choice"
        );
        assert!(e("0.1").starts_with("expected a distribution such as { log_uniform = [0.0001, 0.1] }"));
        assert_eq!(e("{ choice = [] }"), "choice = [] has no value to choose: give at least one");
        assert_eq!(e("{ choice = [1, 2, 1] }"), "choice lists 1 twice (values 1 and 3)");
    }

    #[test]
    fn random_draws_stay_in_bounds_and_cover_them() {
        let mut rng = Rng::new(7, 0);
        let dists = [
            Distribution::Uniform { low: -1.0, high: 1.0 },
            Distribution::LogUniform { low: 1e-4, high: 1e-1 },
            Distribution::Int { low: 2, high: 5 },
            Distribution::LogInt { low: 1, high: 4 },
            Distribution::Choice(vec!["a".into(), "b".into()]),
        ];
        for d in &dists {
            let (low, high) = d.bounds();
            let draws: Vec<f64> = (0..2000).map(|_| d.random(&mut rng)).collect();
            assert!(draws.iter().all(|x| (low..=high).contains(x)), "{d:?}");
            if let Some(n) = d.size() {
                for v in 0..n as usize {
                    let want = low + v as f64;
                    assert!(draws.contains(&want), "{d:?} never drew {want}");
                }
            }
        }
        // Log-uniform: as many draws below 1e-2.5 as above, not a tenth.
        let below = (0..4000).filter(|_| dists[1].random(&mut rng) < 10f64.powf(-2.5)).count();
        assert!((1800..2200).contains(&below), "{below}");
    }

    #[test]
    fn a_space_of_countable_keys_has_a_size() {
        let p = |key: &str, dist| Param { key: key.into(), dist };
        let space = Space(vec![
            p("a", Distribution::Int { low: 1, high: 3 }),
            p("b", Distribution::Choice(vec![1.into(), 2.into()])),
        ]);
        assert_eq!(space.size(), Some(6));
        let mut floats = space.clone();
        floats.0.push(p("c", Distribution::Uniform { low: 0.0, high: 1.0 }));
        assert_eq!(floats.size(), None);
        assert_eq!(space.values(&[2.0, 1.0]), [("a".to_owned(), 2.into()), ("b".to_owned(), 2.into())]);
    }
}
