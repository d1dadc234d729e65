// What UCX's connection manager sends to a server address: a client's connection request, with
// the worker address inside it, for the network tests (tests/net). serve's front door must
// take those bytes, genuine or changed, as it takes any others: UCX 1.22 aborted on one with a
// byte changed in the worker address, when its listener read them.
// Usage: ucx-request ADDRESS SECONDS (connects, and keeps UCX's progress going that long)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "tensorbucket/error.hpp"
#include "ucx.hpp"

using namespace tensorbucket::net::detail;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ucx-request ADDRESS SECONDS\n");
    return 2;
  }
  auto address = parse_address(argv[1], false);
  auto until = Clock::now() + std::chrono::duration<double>(std::strtod(argv[2], nullptr));
  Worker worker;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = address.get();
  params.sockaddr.addrlen = address.length;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};  // the server closing it is expected
  ucp_ep_h ep = nullptr;
  if (auto status = ucx().ep_create(worker.get(), &params, &ep); status != UCS_OK) fail_ucx("ucp_ep_create", status);
  while (Clock::now() < until) {
    worker.progress();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close.flags = UCP_EP_CLOSE_FLAG_FORCE;
  auto closing = ucx().ep_close_nbx(ep, &close);
  if (UCS_PTR_IS_PTR(closing)) ucx().request_free(closing);
  return 0;
}
