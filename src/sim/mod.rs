//! The deterministic simulation harness (feature `sim`): being built (issue 6).
