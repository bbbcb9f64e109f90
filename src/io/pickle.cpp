#include "io/pickle.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <variant>
#include <vector>

#include "ccalloc/errors.hpp"
#include "io/byte_input.hpp"
#include "io/flat_map.hpp"

namespace ccalloc::io {
namespace {

// Pickle opcodes (Python's Lib/pickle.py).
enum Op : std::uint8_t {
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kPopMark = '1',
  kDup = '2',
  kFloat = 'F',
  kInt = 'I',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kLong = 'L',
  kBinInt2 = 'M',
  kNone = 'N',
  kShortBinString = 'U',
  kBinString = 'T',
  kBinUnicode = 'X',
  kAppend = 'a',
  kDict = 'd',
  kEmptyDict = '}',
  kAppends = 'e',
  kGet = 'g',
  kBinGet = 'h',
  kLongBinGet = 'j',
  kList = 'l',
  kEmptyList = ']',
  kPut = 'p',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kBinFloat = 'G',
  kProto = 0x80,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kLong4 = 0x8b,
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kMemoize = 0x94,
  kFrame = 0x95,
};

struct OpName {
  std::uint8_t code;
  const char* name;
};
// Every opcode Python defines, for messages; those the reader does not handle are refused.
constexpr OpName kOpNames[] = {
    {'(', "MARK"},          {'.', "STOP"},
    {'0', "POP"},           {'1', "POP_MARK"},
    {'2', "DUP"},           {'F', "FLOAT"},
    {'I', "INT"},           {'J', "BININT"},
    {'K', "BININT1"},       {'L', "LONG"},
    {'M', "BININT2"},       {'N', "NONE"},
    {'P', "PERSID"},        {'Q', "BINPERSID"},
    {'R', "REDUCE"},        {'S', "STRING"},
    {'T', "BINSTRING"},     {'U', "SHORT_BINSTRING"},
    {'V', "UNICODE"},       {'X', "BINUNICODE"},
    {'a', "APPEND"},        {'b', "BUILD"},
    {'c', "GLOBAL"},        {'d', "DICT"},
    {'}', "EMPTY_DICT"},    {'e', "APPENDS"},
    {'g', "GET"},           {'h', "BINGET"},
    {'i', "INST"},          {'j', "LONG_BINGET"},
    {'l', "LIST"},          {']', "EMPTY_LIST"},
    {'o', "OBJ"},           {'p', "PUT"},
    {'q', "BINPUT"},        {'r', "LONG_BINPUT"},
    {'s', "SETITEM"},       {'t', "TUPLE"},
    {')', "EMPTY_TUPLE"},   {'u', "SETITEMS"},
    {'G', "BINFLOAT"},      {0x80, "PROTO"},
    {0x81, "NEWOBJ"},       {0x82, "EXT1"},
    {0x83, "EXT2"},         {0x84, "EXT4"},
    {0x85, "TUPLE1"},       {0x86, "TUPLE2"},
    {0x87, "TUPLE3"},       {0x88, "NEWTRUE"},
    {0x89, "NEWFALSE"},     {0x8a, "LONG1"},
    {0x8b, "LONG4"},        {0x8c, "SHORT_BINUNICODE"},
    {0x8d, "BINUNICODE8"},  {0x8e, "BINBYTES8"},
    {0x8f, "EMPTY_SET"},    {0x90, "ADDITEMS"},
    {0x91, "FROZENSET"},    {0x92, "NEWOBJ_EX"},
    {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"},
    {0x95, "FRAME"},        {0x96, "BYTEARRAY8"},
    {0x97, "NEXT_BUFFER"},  {0x98, "READONLY_BUFFER"},
    {'B', "BINBYTES"},      {'C', "SHORT_BINBYTES"},
};

const char* op_name(std::uint8_t code) {
  for (const OpName& op : kOpNames) {
    if (op.code == code) return op.name;
  }
  return nullptr;
}

std::uint64_t byteswap64(std::uint64_t v) {
  std::uint64_t r = 0;
  for (int i = 0; i < 8; ++i) {
    r = (r << 8) | (v & 0xff);
    v >>= 8;
  }
  return r;
}

std::string hex_byte(std::uint8_t b) {
  static constexpr char kHex[] = "0123456789abcdef";
  return std::string("0x") + kHex[b >> 4] + kHex[b & 0xf];
}

// What the reader knows about each container it made: whether it is already inside
// another container (then it is complete and may no longer change, which rules out
// cycles), its nesting height, and how many values it holds counting shared containers
// once per reference (which bounds what any traversal of the result costs).
struct Meta {
  std::uint64_t size = 1;
  std::uint32_t height = 0;
  bool sealed = false;
  // Streaming (with a sink): the device_traces list, or one device's list (its entries go
  // to the sink), or an entry handed to the sink (its memo slot is released).
  enum Role : std::uint8_t { kPlain, kTracesRoot, kDeviceList } role = kPlain;
  std::uint32_t device = 0;    // of a kDeviceList
  std::uint64_t streamed = 0;  // entries handed out, of a kDeviceList; devices, of the root
  std::uint64_t memo_slot = std::numeric_limits<std::uint64_t>::max();  // last PUT
};
constexpr std::uint32_t kScalarMeta = 0;
constexpr std::uint32_t kUnsetMeta = std::numeric_limits<std::uint32_t>::max();
// A memo slot whose value was a streamed trace entry, released.
constexpr std::uint32_t kReleasedMeta = kUnsetMeta - 1;

struct Entry {
  Value v;
  std::uint32_t meta = kScalarMeta;
};

constexpr std::size_t kNoRoot = std::numeric_limits<std::size_t>::max();

class Reader final : public ValueParser {
 public:
  Reader(ByteInput& in, const std::string& name, const PickleLimits& limits, TraceEntrySink* sink)
      : in_(in), name_(name), limits_(limits), sink_(sink) {
    metas_.push_back(Meta{});  // kScalarMeta
  }

  bool step() override {
    if (done_) return false;
    op_pos_ = in_.offset();
    if (!in_.ensure(1)) fail("the data ends without a STOP opcode (truncated pickle?)");
    op_ = static_cast<std::uint8_t>(in_.peek());
    in_.skip(1);
    if (op_ == kStop) {
      result_ = stop();
      done_ = true;
      return false;
    }
    step(op_);
    return true;
  }
  Value result() override { return std::move(result_); }

 private:
  // ---- errors --------------------------------------------------------------------------

  [[noreturn]] void fail(const std::string& what) const { fail_at(op_pos_, what); }
  [[noreturn]] void fail_at(std::size_t offset, const std::string& what) const {
    throw FormatError(name_ + ": byte " + std::to_string(offset) + ": " + what);
  }
  std::string current_op() const {
    const char* n = op_name(op_);
    return n != nullptr ? n : "?";
  }

  // ---- input ---------------------------------------------------------------------------

  void need(std::size_t n) {
    if (!in_.ensure(n)) {
      fail(current_op() + " needs " + std::to_string(n) + " byte(s) of argument, but only " +
           std::to_string(in_.available()) + " remain (truncated pickle?)");
    }
  }
  // Valid until the next read.
  const unsigned char* take(std::size_t n) {
    need(n);
    const auto* p = reinterpret_cast<const unsigned char*>(in_.here());
    in_.skip(n);
    return p;
  }
  std::uint8_t u8() { return *take(1); }
  std::uint64_t uint_le(std::size_t n) {
    const unsigned char* p = take(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= std::uint64_t{p[i]} << (8 * i);
    return v;
  }
  std::int32_t i32() { return static_cast<std::int32_t>(static_cast<std::uint32_t>(uint_le(4))); }
  // The argument of a text opcode: up to the next newline (not included).
  // Valid until the next read.
  std::string_view line() {
    std::size_t searched = 0;
    for (;;) {
      const std::string_view window(in_.here(), in_.available());
      const std::size_t nl = window.find('\n', searched);
      if (nl != std::string_view::npos) {
        in_.skip(nl + 1);
        return window.substr(0, nl);
      }
      searched = window.size();
      if (!in_.ensure(searched + 1)) fail(current_op() + " has no terminating newline");
    }
  }
  // A length argument. In memory it must fit in the rest of the input up front; streamed,
  // the bytes are read as they come, so no length can make the reader hold more memory
  // than the input has.
  std::size_t length(std::uint64_t n) {
    const std::optional<std::uint64_t> total = in_.total();
    const std::uint64_t left = total ? *total - in_.offset() : 0;
    if (total && n > left) {
      fail(current_op() + " announces " + std::to_string(n) + " bytes, but only " +
           std::to_string(left) + " remain (truncated or corrupt pickle)");
    }
    if (n > std::numeric_limits<std::size_t>::max() / 2) {
      fail(current_op() + " announces " + std::to_string(n) + " bytes (corrupt pickle)");
    }
    return static_cast<std::size_t>(n);
  }
  // The `n` bytes of a string argument (after length()); valid until the next read.
  std::string_view bytes(std::size_t n) {
    if (!in_.ensure(n)) {
      fail(current_op() + " announces " + std::to_string(n) + " bytes, but only " +
           std::to_string(in_.available()) + " remain (truncated or corrupt pickle)");
    }
    const std::string_view s(in_.here(), n);
    in_.skip(n);
    return s;
  }

  // ---- the stack -----------------------------------------------------------------------

  std::size_t frame_base() const { return marks_.empty() ? 0 : marks_.back(); }
  // Values above the innermost MARK.
  std::size_t avail() const { return stack_.size() - frame_base(); }
  void require(std::size_t n) const {
    if (avail() < n) {
      fail(current_op() + " needs " + std::to_string(n) + " value(s) on the stack" +
           (marks_.empty() ? "" : " above the last MARK") + ", but there are " +
           std::to_string(avail()) + " (stack underflow)");
    }
  }
  void count_value() {
    if (++created_ > limits_.max_items) {
      fail("more than " + std::to_string(limits_.max_items) +
           " values (limit); raise it with the environment variable "
           "CCALLOC_MAX_PICKLE_VALUES");
    }
  }
  void count_string(std::size_t bytes) {
    string_bytes_ += bytes;
    if (string_bytes_ > limits_.max_string_bytes) {
      fail("strings total more than " + std::to_string(limits_.max_string_bytes) +
           " bytes (limit)");
    }
  }
  void push(Value v, std::uint32_t meta = kScalarMeta) {
    count_value();
    stack_.push_back(Entry{std::move(v), meta});
  }
  void push_string(std::string_view s) {
    count_string(s.size());
    push(Value(std::string(s)));
  }
  void push_copy(const Entry& e) {
    if (e.v.is_string()) count_string(e.v.as_string().size());
    count_value();
    stack_.push_back(e);
  }
  std::uint32_t new_meta() {
    if (!free_metas_.empty()) {
      const std::uint32_t meta = free_metas_.back();
      free_metas_.pop_back();
      metas_[meta] = Meta{1, 1, false};
      return meta;
    }
    if (metas_.size() >= kReleasedMeta) fail("too many containers");
    metas_.push_back(Meta{1, 1, false});
    return static_cast<std::uint32_t>(metas_.size() - 1);
  }
  void push_container(Value v) {
    const std::uint32_t meta = new_meta();
    push(std::move(v), meta);
  }
  std::size_t pop_mark() {
    if (marks_.empty()) fail(current_op() + " without a preceding MARK");
    const std::size_t mark = marks_.back();
    marks_.pop_back();
    return mark;
  }

  // ---- containers ----------------------------------------------------------------------

  // `child` goes into the container described by `parent`: it is complete from now on.
  void adopt(std::uint32_t parent, const Entry& child) {
    if (child.meta != kScalarMeta) metas_[child.meta].sealed = true;
    const Meta c = metas_[child.meta];
    Meta& p = metas_[parent];
    p.height = std::max(p.height, c.height + 1);
    if (p.height > limits_.max_depth) {
      fail("containers nested deeper than " + std::to_string(limits_.max_depth) +
           " levels (limit); raise it with the environment variable CCALLOC_MAX_NESTING");
    }
    p.size += c.size;
    if (p.size > limits_.max_items) {
      fail("the data holds more than " + std::to_string(limits_.max_items) +
           " values, counting each reference to a shared container (limit); raise it with the "
           "environment variable CCALLOC_MAX_PICKLE_VALUES");
    }
  }
  // The container an APPEND/SETITEM-style opcode adds to.
  void check_target(const Entry& target, bool want_list) const {
    const bool ok = want_list ? target.v.is_list() : target.v.is_dict();
    if (!ok) {
      fail(current_op() + " needs a " + (want_list ? "list" : "dict") + " below its items, got a " +
           std::string(target.v.kind_name()));
    }
    if (metas_[target.meta].sealed) {
      fail(current_op() +
           " changes a container that is already inside another one (recursive data is not "
           "supported)");
    }
  }
  void check_child(const Entry& target, const Entry& child) const {
    if (child.meta != kScalarMeta && child.v.identity() == target.v.identity()) {
      fail(current_op() + " puts a container inside itself (recursive data is not supported)");
    }
  }
  void check_key(const Entry& key) const {
    if (key.v.is_list() || key.v.is_dict()) {
      fail("a " + std::string(key.v.kind_name()) + " cannot be a dict key (unhashable)");
    }
  }

  // Room for `more` items; geometric, as APPENDS comes in batches of 1000.
  template <typename Vec>
  static void grow(Vec& v, std::size_t more) {
    if (v.capacity() - v.size() < more) v.reserve(std::max(v.size() + more, 2 * v.capacity()));
  }

  void append_items(Entry& target, std::size_t first, std::size_t last) {
    if (sink_ != nullptr) {
      if (metas_[target.meta].role == Meta::kDeviceList) return stream_items(target, first, last);
      if (metas_[target.meta].role == Meta::kTracesRoot) {
        for (std::size_t i = first; i < last; ++i)
          stream_device(target, stack_[i]);
      }
    }
    List& list = target.v.mutable_list();
    grow(list, last - first);
    for (std::size_t i = first; i < last; ++i) {
      check_child(target, stack_[i]);
      adopt(target.meta, stack_[i]);
      list.push_back(std::move(stack_[i].v));
    }
  }
  void set_items(Entry& target, std::size_t first, std::size_t last) {
    if ((last - first) % 2 != 0) {
      fail(current_op() + " needs key/value pairs, got an odd number of items (" +
           std::to_string(last - first) + ")");
    }
    Dict& dict = target.v.mutable_dict();
    grow(dict, (last - first) / 2);
    for (std::size_t i = first; i < last; i += 2) {
      check_key(stack_[i]);
      check_child(target, stack_[i]);
      check_child(target, stack_[i + 1]);
      adopt(target.meta, stack_[i]);
      adopt(target.meta, stack_[i + 1]);
      dict.emplace_back(std::move(stack_[i].v), std::move(stack_[i + 1].v));
    }
  }
  // ---- streaming of device_traces entries -------------------------------------------

  // Whether the list about to be pushed at stack_[p] is the value of the top-level dict's
  // key "device_traces": the dict is stack_[0], with its items (SETITEM) or a MARK and
  // key/value pairs (SETITEMS) above it, the key being the string just below.
  bool traces_value_at(std::size_t p) const {
    if (p < 2 || !stack_[0].v.is_dict()) return false;
    const Value& key = stack_[p - 1].v;
    if (!key.is_string() || key.as_string() != "device_traces") return false;
    if (marks_.empty()) return p == 2;
    return marks_.size() == 1 && marks_[0] == 1 && p % 2 == 0;
  }
  // A new EMPTY_LIST: the device_traces list, or one device's list directly above it
  // (after a MARK, and after the devices before it).
  void classify_list() {
    const std::size_t p = stack_.size() - 1;
    if (traces_root_ != kNoRoot &&
        (traces_root_ >= p || metas_[stack_[traces_root_].meta].role != Meta::kTracesRoot)) {
      traces_root_ = kNoRoot;
    }
    if (traces_root_ == kNoRoot) {
      if (traces_value_at(p)) {
        metas_[stack_[p].meta].role = Meta::kTracesRoot;
        traces_root_ = p;
      }
      return;
    }
    const std::size_t r = traces_root_;
    bool device = p == r + 1;
    if (!device && !marks_.empty() && marks_.back() == r + 1) {
      const Entry& before = stack_[p - 1];
      device = (before.meta == kScalarMeta && before.v.is_none()) ||
               (before.meta != kScalarMeta && metas_[before.meta].role == Meta::kDeviceList);
    }
    if (!device) return;
    Meta& m = metas_[stack_[p].meta];
    m.role = Meta::kDeviceList;
    m.device = static_cast<std::uint32_t>(metas_[stack_[r].meta].streamed + (p - r - 1));
  }
  // Items appended to a device's list go to the sink; the list stays empty.
  void stream_items(Entry& target, std::size_t first, std::size_t last) {
    Meta& t = metas_[target.meta];
    for (std::size_t i = first; i < last; ++i) {
      Entry& child = stack_[i];
      check_child(target, child);
      if (child.meta != kScalarMeta) {
        Meta& c = metas_[child.meta];
        c.sealed = true;
        if (c.height + 1 > limits_.max_depth) adopt(target.meta, child);  // fails
        release_memo(child.meta);
        // Nothing else holds the entry (no memo slot, no stack copy): its record is free.
        if (sole_owner(child.v)) free_metas_.push_back(child.meta);
      }
      sink_->entry(t.device, t.streamed++, std::move(child.v));
    }
  }
  // A device's list appended to the device_traces list: one built item by item was
  // streamed already; one built otherwise (LIST) is streamed now and kept empty.
  void stream_device(Entry& root, Entry& device) {
    Meta& r = metas_[root.meta];
    const auto d = static_cast<std::uint32_t>(r.streamed++);
    if (!device.v.is_list() || device.meta == kScalarMeta ||
        metas_[device.meta].role == Meta::kDeviceList) {
      return;
    }
    List items = std::move(device.v.mutable_list());
    device.v.mutable_list().clear();
    for (std::size_t i = 0; i < items.size(); ++i)
      sink_->entry(d, i, std::move(items[i]));
  }
  static bool sole_owner(const Value& v) {
    return std::visit(
        [](const auto& x) {
          if constexpr (requires { x.use_count(); }) {
            return x.use_count() == 1;
          } else {
            return false;
          }
        },
        v.storage());
  }
  // A streamed entry leaves the memo: a later reference to it is an error.
  void release_memo(std::uint32_t meta) {
    const std::uint64_t slot = metas_[meta].memo_slot;
    Entry* e = nullptr;
    if (slot < memo_.size()) {
      e = &memo_[slot];
    } else if (const auto it = sparse_memo_.find(slot); it != sparse_memo_.end()) {
      e = &it->second;
    }
    if (e != nullptr && e->meta == meta) *e = Entry{Value(), kReleasedMeta};
  }

  // Replaces stack_[first, end) by a new tuple or list of those values.
  void collect(std::size_t first, bool tuple) {
    const std::uint32_t meta = new_meta();
    List items;
    items.reserve(stack_.size() - first);
    for (std::size_t i = first; i < stack_.size(); ++i) {
      adopt(meta, stack_[i]);
      items.push_back(std::move(stack_[i].v));
    }
    stack_.resize(first);
    stack_.push_back(
        Entry{tuple ? Value::tuple(std::move(items)) : Value::list(std::move(items)), meta});
    count_value();
  }
  void collect_dict(std::size_t first) {
    const std::uint32_t meta = new_meta();
    Entry entry{Value::dict(), meta};
    // The dict is new, so it cannot be sealed or inside itself.
    set_items(entry, first, stack_.size());
    stack_.resize(first);
    stack_.push_back(std::move(entry));
    count_value();
  }

  // ---- the memo ------------------------------------------------------------------------

  void memo_put(std::uint64_t index) {
    require(1);
    if (index >= limits_.max_memo) {
      fail("memo index " + std::to_string(index) + " exceeds the limit of " +
           std::to_string(limits_.max_memo) +
           " entries; raise it with the environment variable CCALLOC_MAX_PICKLE_MEMO");
    }
    const Entry& top = stack_.back();
    Entry* slot = nullptr;
    if (index < memo_.size()) {
      slot = &memo_[index];
    } else if (index < 2 * memo_count_ + 1024) {
      // Dense while the indices are (nearly) consecutive, as every pickler writes them, so
      // a large index cannot make the reader allocate a large table.
      memo_.resize(index + 1, Entry{Value(), kUnsetMeta});
      slot = &memo_[index];
    } else {
      slot = &sparse_memo_.try_emplace(index, Entry{Value(), kUnsetMeta}).first->second;
    }
    if (slot->meta == kUnsetMeta && ++memo_count_ > limits_.max_memo) {
      fail("more than " + std::to_string(limits_.max_memo) +
           " memo entries (limit); raise it with the environment "
           "variable CCALLOC_MAX_PICKLE_MEMO");
    }
    if (top.v.is_string()) count_string(top.v.as_string().size());
    if (top.meta != kScalarMeta) metas_[top.meta].memo_slot = index;
    *slot = top;
  }
  void memo_get(std::uint64_t index) {
    const Entry* e = nullptr;
    if (index < memo_.size()) {
      e = &memo_[index];
    } else if (const auto it = sparse_memo_.find(index); it != sparse_memo_.end()) {
      e = &it->second;
    }
    if (e == nullptr || e->meta == kUnsetMeta) {
      fail(current_op() + " of memo index " + std::to_string(index) + ", which was never stored");
    }
    if (e->meta == kReleasedMeta) {
      fail(current_op() + " of memo index " + std::to_string(index) +
           ", an entry of device_traces: entries are streamed and not kept, so they cannot be "
           "referenced again");
    }
    push_copy(*e);
  }

  // ---- text arguments ------------------------------------------------------------------

  std::int64_t parse_decimal(std::string_view s, bool allow_l_suffix) const {
    if (allow_l_suffix && !s.empty() && s.back() == 'L') s.remove_suffix(1);
    if (!s.empty() && s.front() == '+') s.remove_prefix(1);
    std::int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc::result_out_of_range) fail("integer too large (more than 64 bits)");
    if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) {
      fail(current_op() + " has a malformed decimal argument");
    }
    return v;
  }
  std::uint64_t parse_index(std::string_view s) const {
    const std::int64_t v = parse_decimal(s, false);
    if (v < 0) fail(current_op() + " has a negative memo index");
    return static_cast<std::uint64_t>(v);
  }

  // Python's LONG1/LONG4 payload: little-endian two's complement.
  std::int64_t decode_long(const unsigned char* p, std::size_t n) const {
    if (n == 0) return 0;
    const bool negative = (p[n - 1] & 0x80) != 0;
    if (n > 8) {
      // Longer than 8 bytes is fine when the extra bytes only extend the sign.
      const unsigned char fill = negative ? 0xff : 0x00;
      for (std::size_t i = 8; i < n; ++i) {
        if (p[i] != fill)
          fail("integer too large (" + std::to_string(n) + " bytes; at most 64 bits)");
      }
      if (((p[7] & 0x80) != 0) != negative) {
        fail("integer too large (" + std::to_string(n) + " bytes; at most 64 bits)");
      }
      n = 8;
    }
    std::uint64_t u = 0;
    for (std::size_t i = 0; i < n; ++i)
      u |= std::uint64_t{p[i]} << (8 * i);
    if (negative && n < 8) u |= ~std::uint64_t{0} << (8 * n);
    return static_cast<std::int64_t>(u);
  }

  // ---- opcodes -------------------------------------------------------------------------

  Value stop() {
    if (!marks_.empty()) fail("STOP inside an unclosed MARK");
    if (stack_.size() != 1) {
      fail("STOP needs exactly one value on the stack, got " + std::to_string(stack_.size()));
    }
    return std::move(stack_.back().v);
  }

  void step(std::uint8_t op) {
    switch (op) {
      case kProto: {
        const std::uint8_t version = u8();
        if (version > 5) fail("unsupported pickle protocol " + std::to_string(version));
        return;
      }
      case kFrame: {
        // Frames only group opcodes for buffering; streamed, a short frame shows up as a
        // truncated opcode instead.
        const std::uint64_t n = uint_le(8);
        if (const auto total = in_.total(); total && n > *total - in_.offset()) {
          fail("FRAME of " + std::to_string(n) + " bytes, but only " +
               std::to_string(*total - in_.offset()) + " remain (truncated pickle?)");
        }
        return;
      }
      case kMark:
        if (marks_.size() >= limits_.max_depth) {
          fail("more than " + std::to_string(limits_.max_depth) +
               " nested MARKs (limit); raise it with the environment "
               "variable CCALLOC_MAX_NESTING");
        }
        marks_.push_back(stack_.size());
        return;
      case kNone:
        push(Value());
        return;
      case kNewTrue:
        push(Value(true));
        return;
      case kNewFalse:
        push(Value(false));
        return;
      case kInt: {
        const std::string_view s = line();
        if (s == "00" || s == "01") {
          push(Value(s == "01"));
        } else {
          push(Value(parse_decimal(s, false)));
        }
        return;
      }
      case kLong:
        push(Value(parse_decimal(line(), true)));
        return;
      case kFloat: {
        const std::string_view s = line();
        double d = 0;
        const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), d);
        if (ec != std::errc() || ptr != s.data() + s.size()) {
          fail("FLOAT has a malformed argument");
        }
        push(Value(d));
        return;
      }
      case kBinInt:
        push(Value(std::int64_t{i32()}));
        return;
      case kBinInt1:
        push(Value(std::int64_t{u8()}));
        return;
      case kBinInt2:
        push(Value(static_cast<std::int64_t>(uint_le(2))));
        return;
      case kLong1: {
        const std::size_t n = length(u8());
        push(Value(decode_long(take(n), n)));
        return;
      }
      case kLong4: {
        const std::int32_t n = i32();
        if (n < 0) fail("LONG4 with a negative length");
        const std::size_t len = length(static_cast<std::uint64_t>(n));
        push(Value(decode_long(take(len), len)));
        return;
      }
      case kBinFloat: {
        const std::uint64_t be = uint_le(8);
        push(Value(std::bit_cast<double>(byteswap64(be))));
        return;
      }
      case kShortBinUnicode:
      case kShortBinString: {
        const std::size_t n = length(u8());
        push_string(bytes(n));
        return;
      }
      case kBinUnicode: {
        const std::size_t n = length(uint_le(4));
        push_string(bytes(n));
        return;
      }
      case kBinString: {
        const std::int32_t n = i32();
        if (n < 0) fail("BINSTRING with a negative length");
        const std::size_t len = length(static_cast<std::uint64_t>(n));
        push_string(bytes(len));
        return;
      }
      case kBinUnicode8: {
        const std::size_t n = length(uint_le(8));
        push_string(bytes(n));
        return;
      }
      case kEmptyList:
        push_container(Value::list());
        if (sink_ != nullptr) classify_list();
        return;
      case kEmptyDict:
        push_container(Value::dict());
        return;
      case kEmptyTuple:
        push_container(Value::tuple());
        return;
      case kAppend: {
        require(2);
        Entry& target = stack_[stack_.size() - 2];
        check_target(target, true);
        append_items(target, stack_.size() - 1, stack_.size());
        stack_.pop_back();
        return;
      }
      case kAppends: {
        const std::size_t mark = pop_mark();
        if (mark == frame_base()) fail("APPENDS has no list below its MARK (stack underflow)");
        Entry& target = stack_[mark - 1];
        check_target(target, true);
        append_items(target, mark, stack_.size());
        stack_.resize(mark);
        return;
      }
      case kSetItem: {
        require(3);
        Entry& target = stack_[stack_.size() - 3];
        check_target(target, false);
        set_items(target, stack_.size() - 2, stack_.size());
        stack_.resize(stack_.size() - 2);
        return;
      }
      case kSetItems: {
        const std::size_t mark = pop_mark();
        if (mark == frame_base()) fail("SETITEMS has no dict below its MARK (stack underflow)");
        Entry& target = stack_[mark - 1];
        check_target(target, false);
        set_items(target, mark, stack_.size());
        stack_.resize(mark);
        return;
      }
      case kList:
        collect(pop_mark(), false);
        return;
      case kTuple:
        collect(pop_mark(), true);
        return;
      case kDict:
        collect_dict(pop_mark());
        return;
      case kTuple1:
      case kTuple2:
      case kTuple3: {
        const std::size_t n = static_cast<std::size_t>(op - kTuple1) + 1;
        require(n);
        collect(stack_.size() - n, true);
        return;
      }
      case kMemoize:
        memo_put(memo_count_);
        return;
      case kBinPut:
        memo_put(u8());
        return;
      case kLongBinPut:
        memo_put(uint_le(4));
        return;
      case kPut:
        memo_put(parse_index(line()));
        return;
      case kBinGet:
        memo_get(u8());
        return;
      case kLongBinGet:
        memo_get(uint_le(4));
        return;
      case kGet:
        memo_get(parse_index(line()));
        return;
      case kPop:
        // As Python: with nothing above the last MARK, POP drops the MARK.
        if (avail() > 0) {
          stack_.pop_back();
        } else if (!marks_.empty()) {
          marks_.pop_back();
        } else {
          fail("POP on an empty stack (stack underflow)");
        }
        return;
      case kPopMark:
        stack_.resize(pop_mark());
        return;
      case kDup:
        require(1);
        push_copy(Entry(stack_.back()));
        return;
      default:
        break;
    }
    const char* n = op_name(op);
    if (n == nullptr) fail("unknown pickle opcode " + hex_byte(op));
    fail("unsupported pickle opcode " + hex_byte(op) + " ('" + n +
         "'): only plain data is accepted (None, bool, int, float, str, list, tuple, dict)");
  }

  ByteInput& in_;
  const std::string& name_;
  PickleLimits limits_;
  TraceEntrySink* sink_;
  std::uint64_t op_pos_ = 0;
  std::uint8_t op_ = 0;
  bool done_ = false;
  Value result_;
  std::size_t traces_root_ = kNoRoot;  // stack index of the device_traces list, while open
  std::vector<Entry> stack_;
  std::vector<std::size_t> marks_;
  std::vector<Meta> metas_;
  std::vector<std::uint32_t> free_metas_;  // records of streamed entries, for reuse
  std::vector<Entry> memo_;
  std::unordered_map<std::uint64_t, Entry> sparse_memo_;
  std::size_t memo_count_ = 0;
  std::size_t created_ = 0;
  std::size_t string_bytes_ = 0;
};

// ---- writer ------------------------------------------------------------------------------

// Deeper values (only possible through a cycle or a hand-built tree) are refused rather
// than risking the stack.
constexpr std::size_t kMaxPickleDepth = 1000;

class PickleWriter {
 public:
  std::string run(const Value& v) {
    out_.reserve(std::size_t{1} << 16);
    out_ += static_cast<char>(kProto);
    out_ += '\x02';
    write(v, 0);
    out_ += static_cast<char>(kStop);
    return std::move(out_);
  }

 private:
  void op(Op o) { out_ += static_cast<char>(o); }
  void le(std::uint64_t v, std::size_t n) {
    char buf[8];
    for (std::size_t i = 0; i < n; ++i)
      buf[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    out_.append(buf, n);
  }
  void put(std::uint32_t index) {
    if (index < 256) {
      op(kBinPut);
      le(index, 1);
    } else {
      op(kLongBinPut);
      le(index, 4);
    }
  }
  void get(std::uint32_t index) {
    if (index < 256) {
      op(kBinGet);
      le(index, 1);
    } else {
      op(kLongBinGet);
      le(index, 4);
    }
  }
  std::uint32_t next_memo() {
    if (next_memo_ == std::numeric_limits<std::uint32_t>::max()) {
      throw Error("write_pickle: more than 2^32 memo entries");
    }
    return next_memo_++;
  }
  // The memo index a shared container was written under, or nullptr on its first
  // appearance.
  const std::uint32_t* memo_of(const void* id) { return containers_.find(id); }
  void memoize(const void* id) {
    const std::uint32_t index = next_memo();
    containers_.try_emplace(id, index);
    put(index);
  }

  void write_int(std::int64_t i) {
    if (i >= 0 && i <= 0xff) {
      op(kBinInt1);
      le(static_cast<std::uint64_t>(i), 1);
    } else if (i >= 0 && i <= 0xffff) {
      op(kBinInt2);
      le(static_cast<std::uint64_t>(i), 2);
    } else if (i >= std::numeric_limits<std::int32_t>::min() &&
               i <= std::numeric_limits<std::int32_t>::max()) {
      op(kBinInt);
      le(static_cast<std::uint32_t>(static_cast<std::int32_t>(i)), 4);
    } else {
      // The fewest bytes whose sign extension gives back the value.
      std::size_t n = 8;
      while (n > 1) {
        const int shift = static_cast<int>(8 * (n - 1)) - 1;
        const std::int64_t lo = -(std::int64_t{1} << shift);
        const std::int64_t hi = (std::int64_t{1} << shift) - 1;
        if (i < lo || i > hi) break;
        --n;
      }
      op(kLong1);
      le(n, 1);
      le(static_cast<std::uint64_t>(i), n);
    }
  }

  void write_string(const std::string& s) {
    if (!s.empty()) {
      if (const std::uint32_t* index = strings_.find(s)) {
        get(*index);
        return;
      }
    }
    if (s.size() > std::numeric_limits<std::uint32_t>::max()) {
      throw Error("write_pickle: a string of " + std::to_string(s.size()) +
                  " bytes is longer than BINUNICODE allows");
    }
    op(kBinUnicode);
    le(s.size(), 4);
    out_.append(s);
    if (!s.empty()) {
      const std::uint32_t index = next_memo();
      strings_.try_emplace(s, index);
      put(index);
    }
  }

  template <typename Ptr>
  static bool shared(const Ptr& p) {
    return p.use_count() > 1;
  }

  void write(const Value& v, std::size_t depth) {
    if (depth > kMaxPickleDepth) {
      throw Error("write_pickle: values nested deeper than " + std::to_string(kMaxPickleDepth) +
                  " levels (a cycle?)");
    }
    const Value::Storage& s = v.storage();
    switch (s.index()) {
      case 0:
        op(kNone);
        return;
      case 1:
        op(std::get<bool>(s) ? kNewTrue : kNewFalse);
        return;
      case 2:
        write_int(std::get<std::int64_t>(s));
        return;
      case 3:
        op(kBinFloat);
        le(byteswap64(std::bit_cast<std::uint64_t>(std::get<double>(s))), 8);
        return;
      case 4:
        write_string(std::get<std::string>(s));
        return;
      case 5: {
        const Value::ListPtr& l = std::get<Value::ListPtr>(s);
        const bool memo = shared(l);
        if (memo) {
          if (const std::uint32_t* index = memo_of(l.get())) return get(*index);
        }
        op(kEmptyList);
        if (memo) memoize(l.get());
        if (l->empty()) return;
        op(kMark);
        for (const Value& item : *l)
          write(item, depth + 1);
        op(kAppends);
        return;
      }
      case 6: {
        const Value::TuplePtr& t = std::get<Value::TuplePtr>(s);
        const List& items = t->items;
        if (items.empty()) return op(kEmptyTuple);
        const bool memo = shared(t);
        if (memo) {
          if (const std::uint32_t* index = memo_of(t.get())) return get(*index);
        }
        if (items.size() > 3) op(kMark);
        for (const Value& item : items)
          write(item, depth + 1);
        switch (items.size()) {
          case 1:
            op(kTuple1);
            break;
          case 2:
            op(kTuple2);
            break;
          case 3:
            op(kTuple3);
            break;
          default:
            op(kTuple);
        }
        if (memo) memoize(t.get());
        return;
      }
      case 7: {
        const Value::DictPtr& d = std::get<Value::DictPtr>(s);
        const bool memo = shared(d);
        if (memo) {
          if (const std::uint32_t* index = memo_of(d.get())) return get(*index);
        }
        op(kEmptyDict);
        if (memo) memoize(d.get());
        if (d->empty()) return;
        op(kMark);
        for (const auto& [key, value] : *d) {
          write(key, depth + 1);
          write(value, depth + 1);
        }
        op(kSetItems);
        return;
      }
      default:
        return;
    }
  }

  std::string out_;
  std::uint32_t next_memo_ = 0;
  detail::FlatMap<const void*, std::uint32_t> containers_;
  detail::FlatMap<std::string_view, std::uint32_t> strings_;
};

}  // namespace

std::unique_ptr<ValueParser> pickle_parser(ByteInput& in, const std::string& name,
                                           const PickleLimits& limits, TraceEntrySink* sink) {
  return std::make_unique<Reader>(in, name, limits, sink);
}

Value parse_pickle(ByteInput& in, const std::string& name, PickleLimits limits) {
  Reader reader(in, name, limits, nullptr);
  while (reader.step()) {
  }
  return reader.result();
}

Value parse_pickle(std::string_view data, const std::string& name, PickleLimits limits) {
  ByteInput in(data);
  return parse_pickle(in, name, limits);
}

std::string write_pickle(const Value& v) {
  return PickleWriter().run(v);
}

}  // namespace ccalloc::io
