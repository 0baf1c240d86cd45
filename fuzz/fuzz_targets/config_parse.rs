//! Configuration parsing: any text, as TOML or JSON, either parses and validates or is refused
//! with an error; nothing panics, and a valid configuration survives a JSON round trip.
#![no_main]

use canter::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    for parsed in [Config::from_toml_str(text), Config::from_json_str(text)] {
        match parsed {
            Ok(config) => {
                config.validate().expect("from_*_str returns only validated configurations");
                let json = serde_json::to_string(&config).expect("a configuration serializes");
                let back = Config::from_json_str(&json).expect("a valid configuration reads back");
                assert_eq!(back, config);
            }
            Err(error) => assert!(!error.to_string().is_empty()),
        }
    }
});
