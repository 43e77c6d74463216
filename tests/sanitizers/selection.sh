# The tests the sanitizer job runs (tests/sanitizers/run.sh), sourced by it and by
# scripts/test.sh: the suite runs these files once, in the instrumented build, and leaves them
# out of its plain runs on the same chip (a test that passes under AddressSanitizer and
# UndefinedBehaviorSanitizer passes in the plain build; the plain build's own flags are
# exercised by every other file).
# On the cpu chip: the C router (unwrap, routes, fallback, report, errors, ops in several threads
# while the table changes), the adapter loader (broken adapters and ABI 1.0/1.1 tables included),
# sim, its kernels and its streams, and the C hot path of adapter ops and their C host round trip.
SANITIZED_CPU_TESTS="tests/test_device.py tests/test_routes.py tests/test_errors.py
    tests/test_native_mode.py tests/test_adapters.py tests/test_sim.py tests/test_sim_fidelity.py
    tests/test_adapter_loader.py tests/test_streams.py tests/test_threads.py
    tests/test_sim_fast_path.py tests/test_sim_fallback_c.py tests/test_sim_kernels.py"
# Again with FLAGOS_TEST_CHIP=sim: the chip-dependent ones among them.
SANITIZED_SIM_TESTS="tests/test_device.py tests/test_routes.py tests/test_errors.py tests/test_streams.py
    tests/test_fallback_staging.py"
