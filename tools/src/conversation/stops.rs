//! Stop strings (`stop` in the OpenAI API): text is passed on only once no stop string can be
//! starting at its end, and generation ends at the first one, which is not part of the reply.

#[derive(Debug)]
pub(crate) struct StopStrings {
    stops: Vec<String>,
    held: String,
}

impl StopStrings {
    pub(crate) fn new(stops: &[String]) -> StopStrings {
        StopStrings {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Add text; returns what is final, and whether a stop string was reached (then nothing
    /// after it is returned, ever).
    pub(crate) fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(i) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..i].to_string();
            self.held.clear();
            self.stops.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is the start of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(move |&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out: String = self.held.drain(..cut).collect();
        (out, false)
    }

    /// The end of the reply: what was held back is final.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_a_possible_stop_and_cuts_at_one() {
        let mut s = StopStrings::new(&["END".into(), "\n\n".into()]);
        assert_eq!(s.push("Hello E"), ("Hello ".into(), false));
        assert_eq!(s.push("N"), ("".into(), false));
        assert_eq!(s.push("ough"), ("ENough".into(), false));
        assert_eq!(s.push(" now\n"), (" now".into(), false));
        assert_eq!(s.push("\nafter"), ("".into(), true));
        let mut t = StopStrings::new(&["END".into()]);
        assert_eq!(t.push("abcEN"), ("abc".into(), false));
        assert_eq!(t.finish(), "EN");
        let mut u = StopStrings::new(&[]);
        assert_eq!(u.push("é x"), ("é x".into(), false));
    }
}
