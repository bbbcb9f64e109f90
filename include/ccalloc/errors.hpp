// Errors thrown by ccalloc. Every message carries the numbers a user needs to act on it:
// sizes with units, the pointer, the device, the config key and the accepted form.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "ccalloc/driver.hpp"

namespace ccalloc {

// Base class of every error ccalloc throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request could not be satisfied even after the whole OOM ladder. The allocator is
// consistent and usable afterwards.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(std::string message, int device, std::size_t requested_bytes)
      : Error(std::move(message)), device_(device), requested_bytes_(requested_bytes) {}
  int device() const { return device_; }
  std::size_t requested_bytes() const { return requested_bytes_; }

 private:
  int device_;
  std::size_t requested_bytes_;
};

// free() or record_stream() of a pointer that the allocator does not hold: never
// allocated, already freed, or an interior pointer.
class InvalidPointerError : public Error {
 public:
  InvalidPointerError(std::string message, DevicePtr ptr) : Error(std::move(message)), ptr_(ptr) {}
  DevicePtr ptr() const { return ptr_; }

 private:
  DevicePtr ptr_;
};

// A malformed configuration string: the message names the key, the value and the accepted
// form.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A device driver call failed for a reason other than out-of-memory.
class DriverError : public Error {
 public:
  using Error::Error;
};

// A malformed input file (trace CSV, snapshot, RMM log): the message names the file and
// the line or byte offset.
class FormatError : public Error {
 public:
  using Error::Error;
};

// An invariant of the allocator's state does not hold (checker in test builds).
class InvariantError : public Error {
 public:
  using Error::Error;
};

}  // namespace ccalloc
