//! Decoding untrusted payloads: task arguments into typed handler arguments, stored results
//! into typed results, task errors and error codes. Nothing panics; what decodes re-encodes to
//! something that decodes the same.
#![no_main]

use canter::driver::TaskHandle;
use canter::task::{ErrorCode, TaskError};
use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Email {
    to: String,
    subject: Option<String>,
    attempts: u32,
    tags: Vec<String>,
}

fuzz_target!(|bytes: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) else { return };
    let handle: TaskHandle<Email, Email> = TaskHandle::named("email");
    match handle.decode_result(value.clone()) {
        Ok(email) => {
            let again = handle.encode(&email).expect("a decoded value encodes");
            assert_eq!(handle.decode_result(again).expect("and decodes again"), email);
        }
        Err(error) => assert_eq!(error.code, ErrorCode::ResultDeserializationError),
    }
    if let Ok(error) = serde_json::from_value::<TaskError>(value.clone()) {
        let json = serde_json::to_value(&error).expect("a task error encodes");
        assert_eq!(serde_json::from_value::<TaskError>(json).expect("and decodes again"), error);
    }
    if let Ok(code) = serde_json::from_value::<ErrorCode>(value) {
        assert_eq!(ErrorCode::parse(code.as_str()), code);
    }
});
