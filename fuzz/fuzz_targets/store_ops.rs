//! Operation sequences against the memory store, in the vocabulary the claim/cap model
//! (`tests/model_claim_cap.rs`) shares: `canter::sim::store_ops` (enqueue, claim, finish,
//! release, heartbeat, the passing of time, the reaper, under a fuzzed setup). Its harness
//! checks every invariant after every operation and panics on a violation: no cap exceeded
//! (cluster, queue, worker), no task handed out twice, every task present once, attempts and
//! leases never decreasing, every running task held by the worker and lease the store names,
//! every reply in agreement with the rows before the request.
#![no_main]

use canter::sim::store_ops::Input;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input| {
    input.run();
});
