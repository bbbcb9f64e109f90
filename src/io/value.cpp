#include "io/value.hpp"

#include <cmath>
#include <string>

#include "ccalloc/errors.hpp"

namespace ccalloc::io {
namespace {

[[noreturn]] void wrong_kind(std::string_view expected, const Value& got) {
  throw FormatError("expected a " + std::string(expected) + ", got a " +
                    std::string(got.kind_name()));
}

bool equal_lists(const List& a, const List& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i])) return false;
  }
  return true;
}

}  // namespace

bool Value::as_bool() const {
  if (const auto* b = std::get_if<bool>(&v_)) return *b;
  wrong_kind("bool", *this);
}

std::int64_t Value::as_int() const {
  if (const auto* i = std::get_if<std::int64_t>(&v_)) return *i;
  wrong_kind("int", *this);
}

double Value::as_number() const {
  if (const auto* i = std::get_if<std::int64_t>(&v_)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&v_)) return *d;
  wrong_kind("number", *this);
}

const std::string& Value::as_string() const {
  if (const auto* s = std::get_if<std::string>(&v_)) return *s;
  wrong_kind("str", *this);
}

const List& Value::as_list() const {
  if (const auto* l = std::get_if<ListPtr>(&v_)) return **l;
  if (const auto* t = std::get_if<TuplePtr>(&v_)) return (*t)->items;
  wrong_kind("list", *this);
}

const Dict& Value::as_dict() const {
  if (const auto* d = std::get_if<DictPtr>(&v_)) return **d;
  wrong_kind("dict", *this);
}

List& Value::mutable_list() {
  if (auto* l = std::get_if<ListPtr>(&v_)) return **l;
  if (auto* t = std::get_if<TuplePtr>(&v_)) return (*t)->items;
  wrong_kind("list", *this);
}

Dict& Value::mutable_dict() {
  if (auto* d = std::get_if<DictPtr>(&v_)) return **d;
  wrong_kind("dict", *this);
}

const Value* Value::find(std::string_view key) const {
  const auto* d = std::get_if<DictPtr>(&v_);
  if (d == nullptr) return nullptr;
  // From the back: a repeated key takes its last value, as in Python and JavaScript.
  const Dict& items = **d;
  for (auto it = items.rbegin(); it != items.rend(); ++it) {
    const auto* k = std::get_if<std::string>(&it->first.v_);
    if (k != nullptr && *k == key) return &it->second;
  }
  return nullptr;
}

const Value& Value::at(std::string_view key) const {
  if (!is_dict()) wrong_kind("dict", *this);
  const Value* v = find(key);
  if (v == nullptr) throw FormatError("missing key '" + std::string(key) + "'");
  return *v;
}

const void* Value::identity() const {
  if (const auto* l = std::get_if<ListPtr>(&v_)) return l->get();
  if (const auto* t = std::get_if<TuplePtr>(&v_)) return t->get();
  if (const auto* d = std::get_if<DictPtr>(&v_)) return d->get();
  return nullptr;
}

std::string_view Value::kind_name() const {
  static constexpr std::string_view kNames[] = {"None", "bool", "int",   "float",
                                                "str",  "list", "tuple", "dict"};
  static_assert(std::size(kNames) == std::variant_size_v<Storage>);
  return kNames[v_.index()];
}

bool Value::operator==(const Value& other) const {
  if (v_.index() != other.v_.index()) return false;
  // The same container is equal to itself (also when it holds a NaN).
  if (const void* id = identity(); id != nullptr && id == other.identity()) return true;
  switch (v_.index()) {
    case 0:
      return true;
    case 1:
      return std::get<bool>(v_) == std::get<bool>(other.v_);
    case 2:
      return std::get<std::int64_t>(v_) == std::get<std::int64_t>(other.v_);
    case 3: {
      // A NaN equals a NaN: a value read back from a file equals what was written.
      const double a = std::get<double>(v_);
      const double b = std::get<double>(other.v_);
      return a == b || (std::isnan(a) && std::isnan(b));
    }
    case 4:
      return std::get<std::string>(v_) == std::get<std::string>(other.v_);
    case 5:
      return equal_lists(*std::get<ListPtr>(v_), *std::get<ListPtr>(other.v_));
    case 6:
      return equal_lists(std::get<TuplePtr>(v_)->items, std::get<TuplePtr>(other.v_)->items);
    case 7: {
      const Dict& a = *std::get<DictPtr>(v_);
      const Dict& b = *std::get<DictPtr>(other.v_);
      if (a.size() != b.size()) return false;
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (!(a[i].first == b[i].first) || !(a[i].second == b[i].second)) return false;
      }
      return true;
    }
    default:
      return false;
  }
}

}  // namespace ccalloc::io
