// Python binding of the read engine (kernels/aio_read.h), registered by ext.cpp's bind_io.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <stdexcept>

#include "aio_read.h"

namespace nb = nanobind;

namespace {
using I64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Flags = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Results = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
}  // namespace

void bind_io(nb::module_& m) {
  if (!flash::aio_read_available()) return;  // io.aio keeps its own loop (not Linux)
  m.def(
      "aio_read",
      [](uint64_t ctx, I64 fds, I64 offsets, I64 sizes, U64 addresses, std::optional<Flags> vectored, int64_t depth,
         Results res) {
        const size_t n = fds.shape(0);
        if (offsets.shape(0) != n || sizes.shape(0) != n || addresses.shape(0) != n || res.shape(0) != n ||
            (vectored.has_value() && vectored->shape(0) != n))
          throw std::invalid_argument("aio_read: fds, offsets, sizes, addresses, vectored and res differ in length");
        if (ctx == 0) throw std::invalid_argument("aio_read: no AIO context");
        const uint8_t* vec = vectored.has_value() ? vectored->data() : nullptr;
        int64_t error;
        {
          nb::gil_scoped_release release;
          error = flash::aio_read_all(ctx, static_cast<int64_t>(n), fds.data(), offsets.data(), sizes.data(),
                                      addresses.data(), vec, depth, res.data());
        }
        return error;
      },
      nb::arg("ctx"), nb::arg("fds"), nb::arg("offsets"), nb::arg("sizes"), nb::arg("addresses"),
      nb::arg("vectored").none(), nb::arg("depth"), nb::arg("res"),
      "Every read i (sizes[i] bytes at offsets[i] of fds[i] into addresses[i]; vectored[i] != 0: an array of "
      "sizes[i] iovecs there) through the io_setup context ctx with at most depth in flight, in one loop with "
      "the GIL released; res[i] <- bytes read or -errno. Returns 0 or the -errno of a failed io_submit / "
      "io_getevents (every submitted read has completed by then).");
}
