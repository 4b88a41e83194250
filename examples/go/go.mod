module example.com/delayd-worker

go 1.19
