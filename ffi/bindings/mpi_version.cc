#include <mpi.h>

#include <cstring>

#define SPARCML_EXPORT extern "C" __attribute__((visibility("default")))

// Lets Python check that this library and mpi4py talk to the same MPI.
SPARCML_EXPORT void SparcmlMpiLibraryVersion(char* out, int capacity) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::strncpy(out, version, capacity - 1);
  out[capacity - 1] = '\0';
}
