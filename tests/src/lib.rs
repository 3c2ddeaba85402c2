//! Local stack and e2e harness (skeleton).
