//! Choosing the fault (if any) that a request gets.
//!
//! A rule fires only where it can have an effect, so that its `times` counts faults a client
//! actually saw: a body fault waits for a response with a body (not a HEAD, not the Hub's
//! redirect to the CDN), and `IgnoreRange`/`WrongRange` wait for a request that would get a 206.
//! The first rule in the list that matches and still has `times` left fires; one per request.

use crate::{Fault, FaultKind, Where};

/// The listener a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listener {
    Hub,
    Cdn,
}

/// What a request asks for, as far as rules match it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target<'a> {
    /// `/api/models/...` (rules with `file == "api"`).
    Api,
    /// A file by name, on `resolve` or on the CDN (rules whose `file` is a substring of it).
    File(&'a str),
}

/// The answer the request would get without a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A body follows (`ranged`: a 206).
    Body { ranged: bool },
    /// Headers only: HEAD, a redirect, a 416.
    NoBody,
}

/// Takes one firing of the first rule that applies, counting it down.
pub(crate) fn take(rules: &mut [Fault], listener: Listener, target: Target<'_>, shape: Shape) -> Option<FaultKind> {
    let rule = rules.iter_mut().find(|r| {
        r.times > 0 && on_listener(r.on, listener) && matches_target(&r.file, target) && applies(r.kind, shape)
    })?;
    if rule.times != u32::MAX {
        rule.times -= 1;
    }
    Some(rule.kind)
}

fn on_listener(on: Where, listener: Listener) -> bool {
    matches!((on, listener), (Where::Both, _) | (Where::Hub, Listener::Hub) | (Where::Cdn, Listener::Cdn))
}

fn matches_target(pattern: &str, target: Target<'_>) -> bool {
    match target {
        Target::Api => pattern == "api",
        Target::File(name) => name.contains(pattern),
    }
}

fn applies(kind: FaultKind, shape: Shape) -> bool {
    match kind {
        FaultKind::Status(_) | FaultKind::TooMany { .. } => true,
        FaultKind::Drop { .. } | FaultKind::Slow { .. } | FaultKind::WrongLength | FaultKind::Corrupt => {
            matches!(shape, Shape::Body { .. })
        }
        FaultKind::IgnoreRange | FaultKind::WrongRange => shape == Shape::Body { ranged: true },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(file: &str, kind: FaultKind, times: u32, on: Where) -> Fault {
        Fault { file: file.into(), kind, times, on }
    }

    #[test]
    fn counts_down_and_stops() {
        let mut rules = vec![rule("", FaultKind::Status(503), 2, Where::Both)];
        let body = Shape::Body { ranged: false };
        assert_eq!(take(&mut rules, Listener::Hub, Target::File("a"), body), Some(FaultKind::Status(503)));
        assert_eq!(take(&mut rules, Listener::Cdn, Target::File("b"), body), Some(FaultKind::Status(503)));
        assert_eq!(take(&mut rules, Listener::Cdn, Target::File("b"), body), None);
    }

    #[test]
    fn always_never_runs_out() {
        let mut rules = vec![rule("x", FaultKind::Corrupt, u32::MAX, Where::Cdn)];
        for _ in 0..3 {
            let got = take(&mut rules, Listener::Cdn, Target::File("x.bin"), Shape::Body { ranged: false });
            assert_eq!(got, Some(FaultKind::Corrupt));
        }
        assert_eq!(rules[0].times, u32::MAX);
    }

    #[test]
    fn matches_listener_target_and_shape() {
        let mut rules = vec![
            rule("api", FaultKind::Status(500), 1, Where::Hub),
            rule("00002", FaultKind::WrongRange, 1, Where::Cdn),
            rule("", FaultKind::Drop { after_bytes: 1 }, 1, Where::Both),
        ];
        let plain = Shape::Body { ranged: false };
        // The API rule does not match files, the file rule needs a 206, and nothing has a body.
        assert_eq!(take(&mut rules, Listener::Cdn, Target::File("m-00002"), Shape::NoBody), None);
        assert_eq!(
            take(&mut rules, Listener::Hub, Target::File("m-00002"), Shape::Body { ranged: true }),
            Some(FaultKind::Drop { after_bytes: 1 })
        );
        assert_eq!(
            take(&mut rules, Listener::Cdn, Target::File("m-00002"), Shape::Body { ranged: true }),
            Some(FaultKind::WrongRange)
        );
        assert_eq!(take(&mut rules, Listener::Cdn, Target::Api, plain), None);
        assert_eq!(take(&mut rules, Listener::Hub, Target::Api, Shape::NoBody), Some(FaultKind::Status(500)));
    }
}
