// The chat template's renderer: evaluates a parsed template (chat_template_ast.h) over the
// conversation, Jinja's semantics for the subset (loop scopes, undefined values, Python string
// methods and slices), every output byte tagged with the message it came from.
#include "tokenize/chat_template.h"

#include <algorithm>
#include <optional>

#include "tokenize/chat_template_ast.h"

namespace packmoe::tokenize {
namespace {

using namespace jinja;
using Node = ChatTemplate::Node;

// ---- evaluation --------------------------------------------------------------------------------

class Renderer {
 public:
  explicit Renderer(Dict globals) { scopes_.push_back(std::move(globals)); }

  void run(const Node& n, Str& out) {
    switch (n.kind) {
      case Node::Kind::kBlock:
        for (const Node& c : n.body) run(c, out);
        return;
      case Node::Kind::kText:
        append(out, literal(n.text));
        return;
      case Node::Kind::kOutput:
        append(out, to_text(eval(*n.expr), n.line));
        return;
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond))) {
            run(body, out);
            return;
          }
        return;
      case Node::Kind::kFor: {
        const Value seq = eval(*n.expr);
        if (seq.kind != Value::Kind::kList)
          fail(n.line, std::string("'for' over a ") + kind_name(seq.kind) + " is not supported");
        const List items = *seq.list;
        const int64_t len = static_cast<int64_t>(items.size());
        for (int64_t i = 0; i < len; ++i) {
          Value loop;
          loop.kind = Value::Kind::kDict;
          loop.dict = std::make_shared<Dict>(Dict{{"index0", make_int(i)},
                                                  {"index", make_int(i + 1)},
                                                  {"revindex0", make_int(len - 1 - i)},
                                                  {"revindex", make_int(len - i)},
                                                  {"first", make_bool(i == 0)},
                                                  {"last", make_bool(i == len - 1)},
                                                  {"length", make_int(len)}});
          scopes_.push_back(Dict{{n.var, items[static_cast<size_t>(i)]}, {"loop", loop}});
          for (const Node& c : n.body) run(c, out);
          scopes_.pop_back();
        }
        return;
      }
      case Node::Kind::kSet: {
        Value v = eval(*n.expr);
        if (n.attr.empty()) {
          scopes_.back()[n.var] = std::move(v);
          return;
        }
        const Value ns = lookup(n.var);
        if (ns.kind != Value::Kind::kNamespace)
          fail(n.line, "'set " + n.var + "." + n.attr + "' needs a namespace(), '" + n.var +
                           "' is a " + kind_name(ns.kind));
        (*ns.dict)[n.attr] = std::move(v);
        return;
      }
    }
  }

 private:
  Value lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s) {
      auto it = s->find(name);
      if (it != s->end()) return it->second;
    }
    return Value{};
  }

  static Str to_text(const Value& v, int line) {
    switch (v.kind) {
      case Value::Kind::kUndefined:
        return {};
      case Value::Kind::kNone:
        return literal("None");
      case Value::Kind::kBool:
        return literal(v.b ? "True" : "False");
      case Value::Kind::kInt:
        return literal(std::to_string(v.i));
      case Value::Kind::kString:
        return v.s;
      default:
        fail(line, std::string("printing a ") + kind_name(v.kind) + " is not supported");
    }
  }

  static int64_t need_int(const Value& v, int line, const char* what) {
    if (v.kind != Value::Kind::kInt)
      fail(line, std::string(what) + " needs an integer, not a " + kind_name(v.kind));
    return v.i;
  }
  static const Str& need_str(const Value& v, int line, const std::string& what) {
    if (v.kind != Value::Kind::kString)
      fail(line, what + " needs a string, not a " + kind_name(v.kind));
    return v.s;
  }

  Value eval(const Expr& e) {
    using Op = Expr::Op;
    switch (e.op) {
      case Op::kLiteral:
        return e.value;
      case Op::kName:
        return lookup(e.name);
      case Op::kList: {
        Value v;
        v.kind = Value::Kind::kList;
        v.list = std::make_shared<List>();
        for (const ExprP& a : e.args) v.list->push_back(eval(*a));
        return v;
      }
      case Op::kNamespace: {
        Value v;
        v.kind = Value::Kind::kNamespace;
        v.dict = std::make_shared<Dict>();
        for (size_t i = 0; i < e.args.size(); ++i) (*v.dict)[e.keywords[i]] = eval(*e.args[i]);
        return v;
      }
      case Op::kAttr:
        return member(eval(*e.args[0]), e.name, e.line);
      case Op::kIndex: {
        const Value base = eval(*e.args[0]);
        const Value key = eval(*e.args[1]);
        if (key.kind == Value::Kind::kString) return member(base, key.s.s, e.line);
        const int64_t i = need_int(key, e.line, "a subscript");
        if (base.kind == Value::Kind::kList) {
          const int64_t n = static_cast<int64_t>(base.list->size());
          const int64_t j = i < 0 ? i + n : i;
          return j >= 0 && j < n ? (*base.list)[static_cast<size_t>(j)] : Value{};
        }
        if (base.kind == Value::Kind::kString) {
          const int64_t n = static_cast<int64_t>(base.s.s.size());
          const int64_t j = i < 0 ? i + n : i;
          return j >= 0 && j < n ? make_str(substr(base.s, static_cast<size_t>(j), 1)) : Value{};
        }
        fail(e.line, std::string("subscript of a ") + kind_name(base.kind));
      }
      case Op::kSlice:
        return slice(e);
      case Op::kMethod:
        return method(e);
      case Op::kFilter:
        return filter(e);
      case Op::kTest: {
        const Value v = eval(*e.args[0]);
        return make_bool(test(v, e.name, e.line) != e.negated);
      }
      case Op::kNot:
        return make_bool(!truthy(eval(*e.args[0])));
      case Op::kNeg:
        return make_int(-need_int(eval(*e.args[0]), e.line, "'-'"));
      case Op::kAnd: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? eval(*e.args[1]) : a;
      }
      case Op::kOr: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? a : eval(*e.args[1]);
      }
      case Op::kBinary:
        return binary(e, eval(*e.args[0]), eval(*e.args[1]));
    }
    fail(e.line, "unknown expression");
  }

  static Value member(const Value& base, const std::string& name, int line) {
    if (base.kind == Value::Kind::kDict || base.kind == Value::Kind::kNamespace) {
      auto it = base.dict->find(name);
      return it == base.dict->end() ? Value{} : it->second;
    }
    if (base.kind == Value::Kind::kUndefined) fail(line, "'" + name + "' of an undefined value");
    return Value{};  // Jinja: a missing attribute is undefined
  }

  Value slice(const Expr& e) {
    const Value base = eval(*e.args[0]);
    int64_t n = 0;
    if (base.kind == Value::Kind::kList)
      n = static_cast<int64_t>(base.list->size());
    else if (base.kind == Value::Kind::kString)
      n = static_cast<int64_t>(base.s.s.size());
    else
      fail(e.line, std::string("slice of a ") + kind_name(base.kind));
    auto part = [&](int k) -> std::optional<int64_t> {
      if (!e.args[k]) return std::nullopt;
      return need_int(eval(*e.args[k]), e.line, "a slice bound");
    };
    const int64_t step = part(3).value_or(1);
    if (step == 0) fail(e.line, "a slice step of 0");
    // Python's slice.indices.
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + n : *v;
      return step > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t start = clamp(part(1), step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(part(2), step > 0 ? n : -1);
    Value out;
    if (base.kind == Value::Kind::kList) {
      out.kind = Value::Kind::kList;
      out.list = std::make_shared<List>();
    } else {
      out.kind = Value::Kind::kString;
    }
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (base.kind == Value::Kind::kList)
        out.list->push_back((*base.list)[static_cast<size_t>(i)]);
      else
        append(out.s, substr(base.s, static_cast<size_t>(i), 1));
    }
    return out;
  }

  Value method(const Expr& e) {
    const Value base = eval(*e.args[0]);
    std::vector<Value> args;
    for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
    const std::string what = "'." + e.name + "()'";
    if (base.kind != Value::Kind::kString)
      fail(e.line, what + " on a " + kind_name(base.kind) + " is not supported");
    const Str& s = base.s;
    auto arg_str = [&](size_t i) { return need_str(args[i], e.line, what).s; };
    if (e.name == "strip" || e.name == "lstrip" || e.name == "rstrip") {
      if (args.size() > 1) fail(e.line, what + " takes at most one argument");
      const std::string chars = args.empty() ? std::string(" \t\n\r\f\v") : arg_str(0);
      size_t b = 0, en = s.s.size();
      if (e.name != "rstrip")
        while (b < en && chars.find(s.s[b]) != std::string::npos) ++b;
      if (e.name != "lstrip")
        while (en > b && chars.find(s.s[en - 1]) != std::string::npos) --en;
      return make_str(substr(s, b, en - b));
    }
    if (e.name == "startswith" || e.name == "endswith") {
      if (args.size() != 1) fail(e.line, what + " takes one argument");
      const std::string x = arg_str(0);
      const bool hit =
          x.size() <= s.s.size() &&
          (e.name == "startswith" ? s.s.compare(0, x.size(), x) == 0
                                  : s.s.compare(s.s.size() - x.size(), x.size(), x) == 0);
      return make_bool(hit);
    }
    if (e.name == "split") {
      if (args.size() != 1) fail(e.line, what + " is supported with one separator argument only");
      const std::string sep = arg_str(0);
      if (sep.empty()) fail(e.line, what + ": an empty separator");
      Value out;
      out.kind = Value::Kind::kList;
      out.list = std::make_shared<List>();
      size_t from = 0;
      for (;;) {
        const size_t at = s.s.find(sep, from);
        if (at == std::string::npos) break;
        out.list->push_back(make_str(substr(s, from, at - from)));
        from = at + sep.size();
      }
      out.list->push_back(make_str(substr(s, from, s.s.size() - from)));
      return out;
    }
    fail(e.line, "the string method " + what + " is not supported");
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    if ((e.name == "length" || e.name == "count") && e.args.size() == 1) {
      if (v.kind == Value::Kind::kList) return make_int(static_cast<int64_t>(v.list->size()));
      if (v.kind == Value::Kind::kString) return make_int(static_cast<int64_t>(v.s.s.size()));
      if (v.kind == Value::Kind::kDict) return make_int(static_cast<int64_t>(v.dict->size()));
      fail(e.line, std::string("'|") + e.name + "' of a " + kind_name(v.kind));
    }
    if (e.name == "trim" && e.args.size() == 1) {
      const Str& s = need_str(v, e.line, "'|trim'");
      size_t b = 0, en = s.s.size();
      while (b < en && is_space(s.s[b])) ++b;
      while (en > b && is_space(s.s[en - 1])) --en;
      return make_str(substr(s, b, en - b));
    }
    fail(e.line, "the filter '|" + e.name + "' is not supported by packmoe's chat template subset");
  }

  static bool test(const Value& v, const std::string& name, int line) {
    using K = Value::Kind;
    if (name == "defined") return v.kind != K::kUndefined;
    if (name == "undefined") return v.kind == K::kUndefined;
    if (name == "none") return v.kind == K::kNone;
    if (name == "string") return v.kind == K::kString;
    if (name == "number" || name == "integer") return v.kind == K::kInt;
    if (name == "boolean") return v.kind == K::kBool;
    if (name == "true") return v.kind == K::kBool && v.b;
    if (name == "false") return v.kind == K::kBool && !v.b;
    if (name == "mapping") return v.kind == K::kDict;
    if (name == "sequence" || name == "iterable")
      return v.kind == K::kList || v.kind == K::kString || v.kind == K::kDict;
    fail(line, "the test 'is " + name + "' is not supported by packmoe's chat template subset");
  }

  static Value binary(const Expr& e, const Value& a, const Value& b) {
    using K = Value::Kind;
    const std::string& op = e.name;
    if (op == "==") return make_bool(equal(a, b));
    if (op == "!=") return make_bool(!equal(a, b));
    if (op == "~") {
      Str s = to_text(a, e.line);
      append(s, to_text(b, e.line));
      return make_str(std::move(s));
    }
    if (op == "in") {
      bool hit = false;
      if (b.kind == K::kString) {
        hit = b.s.s.find(need_str(a, e.line, "'in' a string").s) != std::string::npos;
      } else if (b.kind == K::kList) {
        hit = std::any_of(b.list->begin(), b.list->end(),
                          [&](const Value& x) { return equal(a, x); });
      } else if (b.kind == K::kDict) {
        hit = b.dict->count(need_str(a, e.line, "'in' a mapping").s) > 0;
      } else {
        fail(e.line, std::string("'in' a ") + kind_name(b.kind));
      }
      return make_bool(hit != e.negated);
    }
    if (op == "+" && a.kind == K::kString && b.kind == K::kString) {
      Str s = a.s;
      append(s, b.s);
      return make_str(std::move(s));
    }
    if (op == "+" && a.kind == K::kList && b.kind == K::kList) {
      Value v;
      v.kind = K::kList;
      v.list = std::make_shared<List>(*a.list);
      v.list->insert(v.list->end(), b.list->begin(), b.list->end());
      return v;
    }
    if (a.kind == K::kString && b.kind == K::kString &&
        (op == "<" || op == ">" || op == "<=" || op == ">=")) {
      const int c = a.s.s.compare(b.s.s);
      return make_bool(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (a.kind == K::kInt && b.kind == K::kInt) {
      int64_t r = 0;
      if (op == "+" && !__builtin_add_overflow(a.i, b.i, &r)) return make_int(r);
      if (op == "-" && !__builtin_sub_overflow(a.i, b.i, &r)) return make_int(r);
      if (op == "*" && !__builtin_mul_overflow(a.i, b.i, &r)) return make_int(r);
      if (op == "<") return make_bool(a.i < b.i);
      if (op == ">") return make_bool(a.i > b.i);
      if (op == "<=") return make_bool(a.i <= b.i);
      if (op == ">=") return make_bool(a.i >= b.i);
      if (op == "+" || op == "-" || op == "*") fail(e.line, "integer overflow in '" + op + "'");
    }
    fail(e.line, "'" + op + "' between a " + kind_name(a.kind) + " and a " + kind_name(b.kind) +
                     " is not supported");
  }

  std::vector<Dict> scopes_;  // globals, then one per enclosing loop iteration
};

}  // namespace

Result<RenderedChat> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                          bool add_generation_prompt,
                                          const ChatVariables& vars) const {
  Value list;
  list.kind = Value::Kind::kList;
  list.list = std::make_shared<List>();
  for (size_t i = 0; i < messages.size(); ++i) {
    Value m;
    m.kind = Value::Kind::kDict;
    Str content;
    content.s = messages[i].content;
    content.src.assign(content.s.size(), static_cast<int32_t>(i));
    m.dict = std::make_shared<Dict>(
        Dict{{"role", make_str(literal(messages[i].role))}, {"content", make_str(content)}});
    list.list->push_back(std::move(m));
  }
  Dict globals{{"messages", list}, {"add_generation_prompt", make_bool(add_generation_prompt)}};
  if (vars.bos_token) globals["bos_token"] = make_str(literal(*vars.bos_token));
  if (vars.eos_token) globals["eos_token"] = make_str(literal(*vars.eos_token));
  try {
    Renderer r(std::move(globals));
    Str out;
    r.run(*root_, out);
    return RenderedChat{std::move(out.s), std::move(out.src)};
  } catch (const TemplateError& e) {
    return Status::error(e.message);
  }
}

}  // namespace packmoe::tokenize
