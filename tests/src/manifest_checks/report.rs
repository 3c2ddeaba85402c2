//! The outcome of a run of checks: one named pass or failure (with why) per check, printed as
//! `PASS <check>` / `FAIL <check>: <why>` lines.

use super::docs::Verdict;
use std::fmt;

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub name: String,
    pub failure: Option<String>,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.failure {
            None => write!(f, "PASS {}", self.name),
            Some(why) => write!(f, "FAIL {}: {why}", self.name),
        }
    }
}

/// Every outcome of a run, in order.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub outcomes: Vec<Outcome>,
}

impl Report {
    pub fn record(&mut self, name: &str, verdict: Verdict) {
        self.outcomes.push(Outcome {
            name: name.to_string(),
            failure: verdict.err(),
        });
    }

    /// The failed outcomes.
    pub fn failures(&self) -> Vec<&Outcome> {
        self.outcomes
            .iter()
            .filter(|o| o.failure.is_some())
            .collect()
    }

    pub fn passed(&self) -> bool {
        self.failures().is_empty()
    }

    /// True when some failure's line (`FAIL <check>: <why>`) contains `text`.
    pub fn refuses_with(&self, text: &str) -> bool {
        self.failures().iter().any(|o| o.to_string().contains(text))
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for outcome in &self.outcomes {
            writeln!(f, "{outcome}")?;
        }
        Ok(())
    }
}
