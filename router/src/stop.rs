//! Stop strings on streamed text.
//!
//! Text arrives in chunks; a stop string may span chunks. The matcher emits text as soon as it
//! cannot be the start of a stop string and holds back the longest suffix that is a proper
//! prefix of some stop string. On a match it returns the text before the match (the stop
//! string itself is not returned, as in OpenAI's API) and the request ends.
//!
//! Invariant: the emitted text never contains the start of a stop string that could still
//! complete, because any such start lies inside the held-back suffix. Cost per chunk:
//! O(held + chunk) × stop strings.

/// What one chunk of text produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; this text is safe to emit (may be empty while text is held back).
    Continue(String),
    /// A stop string matched; this is the text before it, and generation must end.
    Stopped(String),
}

/// Matches a request's stop strings across chunks.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored; validation rejects them anyway).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds a chunk of text.
    pub fn push(&mut self, chunk: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(chunk.to_string());
        }
        self.held.push_str(chunk);
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_match {
            let before = self.held.get(..at).unwrap_or_default().to_string();
            self.held.clear();
            return StopOutcome::Stopped(before);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let split = self.held.len() - keep;
        let rest = self.held.split_off(split);
        StopOutcome::Continue(std::mem::replace(&mut self.held, rest))
    }

    /// No more text: releases whatever was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length in bytes of the longest proper prefix of `stop` that `text` ends with.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    stop.char_indices()
        .map(|(i, _)| i)
        .skip(1)
        .filter_map(|i| stop.get(..i))
        .filter(|prefix| text.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for c in chunks {
            match m.push(c) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn a_match_inside_one_chunk_truncates() {
        assert_eq!(run(&["END"], &["abcENDdef"]), ("abc".into(), true));
    }

    #[test]
    fn a_match_across_chunks_is_found_and_nothing_of_it_leaks() {
        let stops = vec!["STOP".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello S"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("T"), StopOutcome::Continue(String::new()));
        assert_eq!(m.push("OP and more"), StopOutcome::Stopped(String::new()));
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(run(&["STOP"], &["ST", "ART"]), ("START".into(), false));
        assert_eq!(run(&["ab"], &["a", "a", "c"]), ("aac".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["yz", "b"], &["a", "bxyz"]), ("a".into(), true));
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!x"]), ("caf".into(), true));
        assert_eq!(run(&["日本"], &["今日", "本"]), ("今".into(), true));
    }
}
