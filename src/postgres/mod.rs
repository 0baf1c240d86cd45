//! The PostgreSQL store (feature `postgres`): being built (issue 3).
