#include "runtime/status.h"

#include <memory>
#include <string>

#include <gtest/gtest.h>

namespace ejk {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(Status::Ok().ok());
}

TEST(StatusTest, FactoriesSetCodeAndMessage) {
  EXPECT_EQ(Status::InvalidArgument("a").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Status::NotFound("a").code(), StatusCode::kNotFound);
  EXPECT_EQ(Status::Unimplemented("a").code(), StatusCode::kUnimplemented);
  EXPECT_EQ(Status::ResourceExhausted("a").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::FailedPrecondition("a").code(), StatusCode::kFailedPrecondition);
  Status s = Status::Internal("boom");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "boom");
  EXPECT_EQ(s.ToString(), "INTERNAL: boom");
  EXPECT_EQ(Status::InvalidArgument("bad q").ToString(), "INVALID_ARGUMENT: bad q");
}

TEST(StatusTest, CodeNames) {
  EXPECT_STREQ(StatusCodeName(StatusCode::kOk), "OK");
  EXPECT_STREQ(StatusCodeName(StatusCode::kNotFound), "NOT_FOUND");
  EXPECT_STREQ(StatusCodeName(StatusCode::kFailedPrecondition), "FAILED_PRECONDITION");
}

TEST(StatusOrTest, HoldsValueOrStatus) {
  StatusOr<int> value = 42;
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, 42);
  EXPECT_EQ(value.value(), 42);
  EXPECT_TRUE(value.status().ok());

  StatusOr<int> error = Status::NotFound("missing");
  EXPECT_FALSE(error.ok());
  EXPECT_EQ(error.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(error.status().message(), "missing");
}

TEST(StatusOrTest, MovesOutMoveOnlyValues) {
  StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(7);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> taken = std::move(p).value();
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(*taken, 7);

  StatusOr<std::string> s = std::string("abc");
  EXPECT_EQ(s->size(), 3u);
}

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd");
  return x / 2;
}

Status QuarterInto(int x, int* out) {
  EJK_ASSIGN_OR_RETURN(int half, Half(x));
  EJK_ASSIGN_OR_RETURN(*out, Half(half));
  return Status::Ok();
}

Status CheckEven(int x) {
  EJK_RETURN_IF_ERROR(Half(x).status());
  return Status::Ok();
}

TEST(StatusOrTest, Macros) {
  int out = 0;
  EXPECT_TRUE(QuarterInto(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = QuarterInto(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_FALSE(CheckEven(3).ok());
}

}  // namespace
}  // namespace ejk
