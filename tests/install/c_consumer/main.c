/* A C program built against an installed libccalloc.so through pkg-config
   (tests/install/install_test.sh). Needs no GPU: it checks the library's version and two
   errors reported before any device is used. Exits non-zero, naming the value, on a mismatch. */
#include <ccalloc/ccalloc.h>

#include <stdio.h>
#include <string.h>

static int context_value = 1;
static void* capture_context(void* user_data) {
  (void)user_data;
  return &context_value;
}

int main(int argc, char** argv) {
  int failures = 0;
  if (argc != 2) {
    fprintf(stderr, "usage: c_consumer EXPECTED_VERSION\n");
    return 2;
  }
  if (strcmp(ccalloc_version(), argv[1]) != 0) {
    fprintf(stderr, "c_consumer: ccalloc_version() is '%s', expected '%s'\n", ccalloc_version(),
            argv[1]);
    ++failures;
  }
  ccalloc_status s = ccalloc_record_history("sometimes", "all", "cpp", 10);
  if (s != CCALLOC_ERROR_CONFIG || strstr(ccalloc_last_error(), "'sometimes'") == NULL) {
    fprintf(stderr, "c_consumer: record_history(\"sometimes\") gave %d, '%s'\n", (int)s,
            ccalloc_last_error());
    ++failures;
  }
  s = ccalloc_dump_snapshot(NULL);
  if (s != CCALLOC_ERROR_INVALID_VALUE ||
      strcmp(ccalloc_last_error(), "ccalloc_dump_snapshot: path is NULL") != 0) {
    fprintf(stderr, "c_consumer: dump_snapshot(NULL) gave %d, '%s'\n", (int)s,
            ccalloc_last_error());
    ++failures;
  }
  /* Caller contexts from C: a capture without a release is refused before anything runs. */
  s = ccalloc_record_history_context("all", "all", "none", 10, capture_context, NULL, NULL);
  if (s != CCALLOC_ERROR_INVALID_VALUE || strstr(ccalloc_last_error(), "release is NULL") == NULL) {
    fprintf(stderr, "c_consumer: record_history_context without release gave %d, '%s'\n",
            (int)s, ccalloc_last_error());
    ++failures;
  }
  s = ccalloc_snapshot_segment_count(NULL, NULL);
  if (s != CCALLOC_ERROR_INVALID_VALUE) {
    fprintf(stderr, "c_consumer: snapshot_segment_count(NULL) gave %d\n", (int)s);
    ++failures;
  }
  if (failures == 0) printf("c_consumer: all values as expected\n");
  return failures == 0 ? 0 : 1;
}
